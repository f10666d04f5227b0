// Package httpjson makes a ServeMux answer requests that match no route
// the way the servers answer every other error: a JSON object
// {"error": "…"}, 404 for an unknown path and 405 (with Allow) for a
// method the path does not take, instead of Go's plain-text pages.
package httpjson

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// Errors serves mux, answering the requests no route of mux matches with a
// JSON error.
func Errors(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h, pattern := mux.Handler(r)
		if pattern != "" { // a route, or a redirect to a clean path
			mux.ServeHTTP(w, r)
			return
		}
		// The mux's own answer says which: 404, or 405 with Allow.
		rec := &recorder{header: http.Header{}}
		h.ServeHTTP(rec, r)
		switch rec.code {
		case http.StatusMethodNotAllowed:
			allow := rec.header.Get("Allow")
			w.Header().Set("Allow", allow)
			Write(w, http.StatusMethodNotAllowed, fmt.Sprintf("%s %s: method not allowed (allowed: %s)", r.Method, r.URL.Path, allow))
		default:
			Write(w, http.StatusNotFound, fmt.Sprintf("%s %s: no such endpoint", r.Method, r.URL.Path))
		}
	})
}

// Write answers code with {"error": msg}.
func Write(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": msg})
}

// recorder keeps the status and headers of the mux's fallback answer and
// drops its body.
type recorder struct {
	header http.Header
	code   int
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
}

func (r *recorder) Write(b []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	return len(b), nil
}
