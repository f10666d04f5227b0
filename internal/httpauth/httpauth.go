// Package httpauth is the bearer-token check both HTTP servers (the
// runner's admin endpoint and the coordinator's API) use, so that they
// accept exactly the same headers.
package httpauth

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
)

// Bearer reports whether r carries exactly one "Authorization: Bearer
// <token>" header with the given token. The scheme is case-insensitive
// (RFC 9110 §11.1), so "bearer" and "BEARER" are accepted; one or more
// spaces may separate it from the token. The tokens are compared through
// their SHA-256 digests in constant time, so neither the content nor the
// length of the configured token leaks through timing.
func Bearer(r *http.Request, token string) bool {
	values := r.Header.Values("Authorization")
	if len(values) != 1 {
		return false
	}
	scheme, cred, ok := strings.Cut(strings.TrimSpace(values[0]), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return false
	}
	got, want := sha256.Sum256([]byte(strings.TrimLeft(cred, " "))), sha256.Sum256([]byte(token))
	return subtle.ConstantTimeCompare(got[:], want[:]) == 1
}

// Require wraps next so that, when token is not empty, a request without
// the bearer token gets 401 with a WWW-Authenticate challenge for realm and
// a JSON body {"error": "..."}. With an empty token every request passes
// (the binaries refuse an empty token off loopback).
func Require(token, realm string, next http.HandlerFunc) http.HandlerFunc {
	if token == "" {
		return next
	}
	return func(w http.ResponseWriter, r *http.Request) {
		if !Bearer(r, token) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="`+realm+`"`)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_ = json.NewEncoder(w).Encode(map[string]string{"error": "missing or wrong bearer token"})
			return
		}
		next(w, r)
	}
}

// MaxTokenLen bounds a token: it travels in a header of every request.
const MaxTokenLen = 4096

// CheckToken reports whether token can be sent in an Authorization header:
// 1 to MaxTokenLen visible ASCII characters (no spaces, no control
// characters, no newline left over from a file). The message never quotes
// the token.
func CheckToken(token string) error {
	if token == "" || len(token) > MaxTokenLen {
		return fmt.Errorf("must be 1 to %d characters, got %d", MaxTokenLen, len(token))
	}
	for i := 0; i < len(token); i++ {
		if c := token[i]; c < 0x21 || c > 0x7e {
			return fmt.Errorf("must be visible ASCII characters (a header cannot carry the character at position %d)", i+1)
		}
	}
	return nil
}
