package httpauth

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestBearer(t *testing.T) {
	for _, tc := range []struct {
		headers []string
		ok      bool
	}{
		{[]string{"Bearer s3cret"}, true},
		{[]string{"bearer s3cret"}, true},
		{[]string{"BEARER s3cret"}, true},
		{[]string{"Bearer   s3cret"}, true},
		{nil, false},
		{[]string{""}, false},
		{[]string{"Bearer"}, false},
		{[]string{"Bearer "}, false},
		{[]string{"Bearer s3cre"}, false},
		{[]string{"Bearer s3cret!"}, false},
		{[]string{"Basic s3cret"}, false},
		{[]string{"Bearers3cret"}, false},
		{[]string{"s3cret"}, false},
		{[]string{"Bearer s3cret", "Bearer s3cret"}, false}, // two headers: ambiguous
	} {
		r := httptest.NewRequest("POST", "/", nil)
		for _, h := range tc.headers {
			r.Header.Add("Authorization", h)
		}
		if got := Bearer(r, "s3cret"); got != tc.ok {
			t.Errorf("%q: %v, want %v", tc.headers, got, tc.ok)
		}
	}
}

func TestRequire(t *testing.T) {
	ok := func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(204) }
	h := Require("tok", "test", ok)
	r := httptest.NewRequest("POST", "/", nil)
	w := httptest.NewRecorder()
	h(w, r)
	if w.Code != 401 || w.Header().Get("WWW-Authenticate") != `Bearer realm="test"` || w.Body.String() != "{\"error\":\"missing or wrong bearer token\"}\n" {
		t.Fatalf("no token: %d %q %q", w.Code, w.Header(), w.Body)
	}
	r.Header.Set("Authorization", "bearer tok")
	w = httptest.NewRecorder()
	h(w, r)
	if w.Code != 204 {
		t.Fatalf("lower-case scheme refused: %d", w.Code)
	}
	w = httptest.NewRecorder()
	Require("", "test", ok)(w, httptest.NewRequest("POST", "/", nil))
	if w.Code != 204 {
		t.Fatalf("no token configured: %d", w.Code)
	}
}
