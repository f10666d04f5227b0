package jsonbody

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

type inner struct {
	Name string `json:"name"`
}

type request struct {
	Kind    string          `json:"kind"`
	Count   *int            `json:"count,omitempty"`
	Payload json.RawMessage `json:"payload,omitempty"`
	At      *time.Time      `json:"at,omitempty"`
	Inner   *inner          `json:"inner,omitempty"`
	Tags    map[string]int  `json:"tags,omitempty"`
	Skipped string          `json:"-"`
	NoTag   bool
}

func TestDecodeAcceptsStrictJSON(t *testing.T) {
	var r request
	body := ` {"kind": "a\u00e9\ud83d\ude00", "count": 3, "payload": {"x": [1, 2.5e-3, "y", null, true]},
		"at": "2026-05-01T12:00:00Z", "inner": {"name": "n"}, "tags": {"a": 1}, "NoTag": true} `
	if err := Decode([]byte(body), &r); err != nil {
		t.Fatal(err)
	}
	if r.Kind != "aé😀" || *r.Count != 3 || string(r.Payload) != `{"x": [1, 2.5e-3, "y", null, true]}` ||
		!r.At.Equal(time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)) || r.Inner.Name != "n" || r.Tags["a"] != 1 || !r.NoTag {
		t.Fatalf("decoded %+v", r)
	}
	var batch []request
	if err := Decode([]byte(`[{"kind": "a"}, {"kind": "b"}]`), &batch); err != nil || len(batch) != 2 || batch[1].Kind != "b" {
		t.Fatalf("batch: %v %+v", err, batch)
	}
	if err := Check([]byte(`{"a": {"a": {"a": 1}}, "b": [{"a": 1}, {"a": 2}]}`)); err != nil {
		t.Fatalf("the same key in different objects is fine: %v", err)
	}
}

func TestDecodeRejectsAmbiguity(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		path       string // rendered path of the error
		want       string // in the problem
	}{
		{"trailing brace", `{"kind":"noop"}}`, "", "unexpected data after the JSON value"},
		{"trailing bracket", `[{"kind":"noop"}]]`, "", "unexpected data after the JSON value"},
		{"second value", `{"kind":"a"} {"kind":"b"}`, "", "unexpected data after the JSON value"},
		{"case-insensitive name", `{"KIND": "noop"}`, "KIND", `did you mean "kind"`},
		{"unknown field", `{"kind": "a", "priority": 1}`, "priority", "unknown field"},
		{"duplicate key", `{"kind": "a", "kind": "b"}`, "", `duplicate key "kind"`},
		{"escaped duplicate key", `{"kind": "a", "\u006bind": "b"}`, "", `duplicate key "kind"`},
		{"duplicate in payload", `{"kind": "a", "payload": {"x": 1, "x": 2}}`, "payload", `duplicate key "x"`},
		{"duplicate deep in a batch", `[{"kind": "a"}, {"kind": "b", "payload": [{"y": {"z": 1, "z": 1}}]}]`, "[1].payload[0].y", `duplicate key "z"`},
		{"NUL escape", `{"kind": "a\u0000b"}`, "kind", `\u0000`},
		{"NUL in payload", `{"kind": "a", "payload": {"s": "\u0000"}}`, "payload.s", `\u0000`},
		{"NUL in a key", `{"kind": "a", "payload": {"\u0000": 1}}`, "payload", `\u0000`},
		{"lone high surrogate", `{"kind": "a", "payload": "\ud800"}`, "payload", "lone UTF-16 surrogate"},
		{"lone low surrogate", `{"kind": "\udc00"}`, "kind", "lone UTF-16 surrogate"},
		{"high then not low", `{"kind": "\ud800\u0041"}`, "kind", "lone UTF-16 surrogate"},
		{"invalid UTF-8 in kind", "{\"kind\": \"a\xffb\"}", "kind", "invalid UTF-8"},
		{"invalid UTF-8 in a key", "{\"k\xc0\": 1}", "", "invalid UTF-8"},
		{"raw control character", "{\"kind\": \"a\tb\"}", "kind", "control character"},
		{"huge exponent", `{"kind": "a", "payload": 1e131072}`, "payload", "exponent"},
		{"tiny exponent", `{"kind": "a", "payload": 0.0e-99999}`, "payload", "exponent"},
		{"long number", `{"kind": "a", "payload": ` + strings.Repeat("1", MaxNumberLen+1) + `}`, "payload", "longer than"},
		{"leading zero", `{"count": 01}`, "", "invalid character '1' after object value"},
		{"too deep", `{"kind": "a", "payload": ` + strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth) + `}`, "payload[0][0][0][0][0][0][0]…", "nested deeper"},
		{"empty", ` `, "", "no JSON value"},
		{"null for a struct", `null`, "", "got null"},
		{"array for an object", `[]`, "", "must be a JSON object"},
		{"wrong type", `{"count": "3"}`, "count", "must be an integer"},
		{"overflow", `{"count": 99999999999999999999}`, "count", "must be an integer"},
		{"fraction for an int", `{"count": 1.5}`, "count", "must be an integer"},
		{"bad time", `{"at": "yesterday"}`, "at", "RFC 3339"},
		{"unknown nested field", `{"inner": {"Name": "x"}}`, "inner.Name", "case-sensitive"},
		{"invalid escape", `{"kind": "\x"}`, "kind", "invalid escape"},
		{"truncated", `{"kind": "a"`, "", "unexpected end"},
		{"single quotes", `{'kind': 1}`, "", "invalid character"},
		{"BOM", "\ufeff{}", "", "invalid character"},
		{"NaN", `{"count": NaN}`, "count", "invalid character"},
		{"trailing comma", `{"kind": "a",}`, "", "invalid character ','"},
	} {
		var r request
		err := Decode([]byte(tc.body), &r)
		var je *Error
		if !errors.As(err, &je) || !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want an *Error", tc.name, err)
			continue
		}
		if je.PathString() != tc.path || !strings.Contains(je.Problem, tc.want) {
			t.Errorf("%s: path %q problem %q, want path %q and %q", tc.name, je.PathString(), je.Problem, tc.path, tc.want)
		}
		if strings.Contains(je.Error(), "\n") {
			t.Errorf("%s: error spans lines: %q", tc.name, je.Error())
		}
	}
}

// A null given for a typed field is refused, not read as the field left
// out (issue 34: "priority": null took the default priority); opaque JSON
// keeps null as a value.
func TestNullIsNotALeftOutField(t *testing.T) {
	for _, tc := range []struct{ body, path, want string }{
		{`{"kind": null}`, "kind", "must not be null (leave the field out instead)"},
		{`{"count": null}`, "count", "must not be null (leave the field out instead)"},
		{`{"at": null}`, "at", "must not be null (leave the field out instead)"},
		{`{"inner": null}`, "inner", "must not be null (leave the field out instead)"},
		{`{"inner": {"name": null}}`, "inner.name", "must not be null (leave the field out instead)"},
		{`{"tags": {"a": null}}`, "tags.a", "must not be null"},
		{`{"NoTag": null}`, "NoTag", "must not be null (leave the field out instead)"},
	} {
		var r request
		err := Decode([]byte(tc.body), &r)
		var je *Error
		if !errors.As(err, &je) || je.PathString() != tc.path || je.Problem != tc.want {
			t.Errorf("%s: %v, want %q at %q", tc.body, err, tc.want, tc.path)
		}
	}
	var batch []request
	err := Decode([]byte(`[{"kind": "a"}, {"kind": "b", "count": null}]`), &batch)
	var je *Error
	if !errors.As(err, &je) || je.Field() != "count" {
		t.Errorf("null in a batch: %v, want an *Error naming count", err)
	} else if i, ok := je.Index(); !ok || i != 1 {
		t.Errorf("null in a batch: index %d %v, want 1", i, ok)
	}
	if err := Decode([]byte(`[{"kind": "a"}, null]`), &batch); err == nil || !strings.Contains(err.Error(), "[1]: must not be null") {
		t.Errorf("a null element: %v", err)
	}
	var r request
	if err := Decode([]byte(`{"kind": "a", "payload": null}`), &r); err != nil || string(r.Payload) != "null" {
		t.Errorf("a null payload (opaque JSON): %v %q", err, r.Payload)
	}
	if err := Decode([]byte(`{"kind": "a", "payload": {"x": [null, {"y": null}]}}`), &r); err != nil {
		t.Errorf("nulls inside a payload: %v", err)
	}
	var anything map[string]any
	if err := Decode([]byte(`{"a": null}`), &anything); err != nil {
		t.Errorf("null into an interface: %v", err)
	}
}

func TestErrorNamesIndexAndField(t *testing.T) {
	var batch []request
	err := Decode([]byte(`[{"kind": "a"}, {"kind": "b", "count": "x"}]`), &batch)
	var je *Error
	if !errors.As(err, &je) {
		t.Fatal(err)
	}
	if i, ok := je.Index(); !ok || i != 1 || je.Field() != "count" {
		t.Fatalf("index %d %v field %q from %v", i, ok, je.Field(), err)
	}
	if !strings.Contains(err.Error(), "[1].count") {
		t.Fatalf("message does not name the place: %v", err)
	}
}

func TestErrorsDoNotEchoTheBody(t *testing.T) {
	secret := strings.Repeat("s3cret", 100)
	err := Check([]byte(`{"a": "` + secret + `"} trailing ` + secret))
	if err == nil || strings.Contains(err.Error(), secret) || len(err.Error()) > 200 {
		t.Fatalf("error echoes the input: %v", err)
	}
}

// FuzzDecode checks the decoder against encoding/json (v1): it never panics,
// rejects only with an *Error, and what it accepts is valid UTF-8 JSON that
// encoding/json decodes to the same value, with no NUL and no U+FFFD that
// was not in the input.
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		`{"kind": "noop"}`, `[{"kind": "a", "payload": {"x": 1}}]`, `{"kind":"noop"}}`, `{"KIND": "a"}`,
		`{"kind": "a", "kind": "b"}`, `{"kind": "\u0000"}`, `{"payload": "\ud800"}`, "{\"kind\": \"\xff\"}",
		`{"count": 1e999}`, `{"at": "0001-01-01T00:00:00Z"}`, `{"inner": {"name": "x"}, "tags": {"a": 1}}`, `null`, `"\ud83d\ude00"`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var r request
		err := Decode(data, &r)
		cerr := Check(data)
		if err != nil {
			var je *Error
			if !errors.As(err, &je) {
				t.Fatalf("Decode(%q) = %v, not an *Error", data, err)
			}
			return
		}
		if cerr != nil {
			t.Fatalf("Decode accepted %q but Check refused it: %v", data, cerr)
		}
		if !utf8.Valid(data) || !json.Valid(data) {
			t.Fatalf("accepted invalid UTF-8 or JSON: %q", data)
		}
		var want request
		if err := json.Unmarshal(data, &want); err != nil {
			t.Fatalf("accepted %q, which encoding/json refuses: %v", data, err)
		}
		if !reflect.DeepEqual(normal(r), normal(want)) {
			t.Fatalf("decoded %q differently from encoding/json:\n got %+v\nwant %+v", data, r, want)
		}
		for _, s := range []string{r.Kind, string(r.Payload)} {
			if strings.ContainsRune(s, 0) || (strings.ContainsRune(s, utf8.RuneError) && !strings.ContainsRune(string(data), utf8.RuneError)) {
				t.Fatalf("accepted a NUL or a replaced character: %q", data)
			}
		}
	})
}

// normal makes two decodings comparable (time.Time holds a location pointer).
func normal(r request) request {
	if r.At != nil {
		at := r.At.UTC()
		r.At = &at
	}
	return r
}

// Given tells a member left out from one given with its zero value, for
// an object and for each object of an array; an embedded struct's fields
// are the object's own, for the decoder's checks too (null, unknown
// names).
func TestGivenAndEmbeddedFields(t *testing.T) {
	type withEmbedded struct {
		Kind string `json:"kind"`
		Opts
	}
	var v withEmbedded
	if err := Decode([]byte(`{"kind": "k", "queue": "", "priority": 2}`), &v); err != nil || v.Queue != "" || v.Priority != 2 {
		t.Fatalf("decoded %+v %v", v, err)
	}
	if got := Given([]byte(`{"kind": "k", "queue": "", "priority": 2}`)); len(got) != 1 ||
		!got[0]["queue"] || !got[0]["priority"] || !got[0]["kind"] || len(got[0]) != 3 {
		t.Fatalf("Given of an object: %v", got)
	}
	if got := Given([]byte(`[{"kind": "a"}, 1, {"queue": "q", "x": {"priority": 1}}, []]`)); len(got) != 4 ||
		!got[0]["kind"] || got[1] != nil || !got[2]["queue"] || !got[2]["x"] || got[2]["priority"] || got[3] != nil {
		t.Fatalf("Given of an array: %v", got)
	}
	if got := Given([]byte(`"text"`)); got != nil {
		t.Fatalf("Given of a string: %v", got)
	}
	var je *Error
	if err := Decode([]byte(`{"kind": "k", "queue": null}`), &v); !errors.As(err, &je) || je.Field() != "queue" ||
		!strings.Contains(je.Problem, "leave the field out") {
		t.Fatalf("null in an embedded field: %v", err)
	}
	if err := Decode([]byte(`{"kind": "k", "Queue": "q"}`), &v); !errors.As(err, &je) || !strings.Contains(je.Problem, `did you mean "queue"`) {
		t.Fatalf("a miscased embedded field: %v", err)
	}
}

// Opts is an exported struct to embed (an unexported one's fields are
// not decoded into).
type Opts struct {
	Queue    string `json:"queue,omitempty"`
	Priority int    `json:"priority,omitempty"`
}
