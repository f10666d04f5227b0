// Package jsonbody decodes JSON that comes from outside the process (HTTP
// request bodies, task payloads) strictly, so that no input means two
// things. The JSON is parsed by github.com/go-json-experiment/json, the
// module of Go's encoding/json/v2 semantics, which already refuses:
//
//   - anything but one JSON value (RFC 8259): no trailing data, not even a
//     second value;
//   - invalid UTF-8, on the raw bytes, and lone UTF-16 surrogate escapes
//     (encoding/json replaces both with U+FFFD, so a key would hash to
//     another shard than the one its producer computed);
//   - the same member name twice in an object, at any depth
//     (encoding/json keeps the last one, PostgreSQL's jsonb too, so the
//     first value vanishes);
//   - when decoding into a struct, a member that names no field exactly:
//     names are case-sensitive (encoding/json matches them
//     case-insensitively) and unknown members are refused.
//
// What is this project's own is checked here, because PostgreSQL refuses
// it or because every decoder downstream recurses:
//
//   - no string holds \u0000 (PostgreSQL refuses it in text and jsonb);
//   - numbers have at most MaxNumberLen characters and an exponent within
//     ±MaxExponent, well inside what PostgreSQL's numeric stores;
//   - nesting is at most MaxDepth deep;
//   - when decoding, null is refused wherever it would be decoded into a
//     typed Go value (a struct field, a pointer, a slice element or map
//     value that is not opaque JSON): encoding/json and v2 decode it to
//     the zero value, which reads as "left out", so that `"queue": null`
//     and `"priority": null` would silently take the defaults. A field is
//     given with a value or left out. Opaque JSON (json.RawMessage,
//     jsontext.Value, interfaces) keeps null as a value of its own.
//
// Errors are *Error values that say where (the path of keys and indices,
// and the byte offset) and what, without echoing more than a short quote of
// the input.
package jsonbody

import (
	"bytes"
	stdjson "encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// Limits of what Check and Decode accept.
const (
	// MaxDepth bounds the nesting of arrays and objects. Data is never this
	// deep; recursion in every decoder downstream is.
	MaxDepth = 1000
	// MaxNumberLen and MaxExponent bound numbers. PostgreSQL's numeric
	// holds 131,072 digits before the point and 16,383 after; a number of
	// at most 1,000 characters with an exponent within ±1,000 always fits.
	MaxNumberLen = 1000
	MaxExponent  = 1000
)

// maxPathShown bounds the path in messages (a deeply nested value would
// otherwise make a message of kilobytes).
const maxPathShown = 8

// ErrInvalid is matched (errors.Is) by every *Error.
var ErrInvalid = errors.New("invalid JSON")

// Error is what is wrong with a JSON text, and where.
type Error struct {
	// Path leads from the top-level value to the offending one: object
	// keys (string) and array indices (int). Empty for the whole text.
	Path []any
	// Offset is the byte offset in the text where the problem was found.
	Offset int
	// Problem says what is wrong.
	Problem string
}

func (e *Error) Error() string {
	if p := e.PathString(); p != "" {
		return fmt.Sprintf("%s: %s (at byte %d)", p, e.Problem, e.Offset)
	}
	return fmt.Sprintf("%s (at byte %d)", e.Problem, e.Offset)
}

// Is makes errors.Is(err, ErrInvalid) true.
func (e *Error) Is(target error) bool { return target == ErrInvalid }

// PathString renders Path as in `[2].payload.name`, at most maxPathShown
// elements of it.
func (e *Error) PathString() string {
	var b strings.Builder
	for i, p := range e.Path {
		if i == maxPathShown {
			b.WriteString("…")
			break
		}
		switch p := p.(type) {
		case int:
			fmt.Fprintf(&b, "[%d]", p)
		case string:
			if b.Len() > 0 {
				b.WriteByte('.')
			}
			b.WriteString(p)
		}
	}
	return b.String()
}

// Index returns the leading array index of Path, if there is one: which
// element of a batch is wrong.
func (e *Error) Index() (int, bool) {
	if len(e.Path) > 0 {
		if i, ok := e.Path[0].(int); ok {
			return i, true
		}
	}
	return 0, false
}

// Field returns the first object key of Path (after a leading index): the
// top-level field that is wrong, or "".
func (e *Error) Field() string {
	for _, p := range e.Path {
		if s, ok := p.(string); ok {
			return s
		}
	}
	return ""
}

// TooLargeError is returned by ReadRequest when the body exceeds its limit.
type TooLargeError struct{ Limit int64 }

func (e *TooLargeError) Error() string {
	return fmt.Sprintf("request body larger than %d bytes", e.Limit)
}

// ReadRequest reads r's body, at most limit bytes. A longer body is a
// *TooLargeError (and the connection is closed after the response, as
// http.MaxBytesReader does).
func ReadRequest(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, error) {
	b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, &TooLargeError{Limit: tooBig.Limit}
		}
		return nil, fmt.Errorf("reading request body: %w", err)
	}
	return b, nil
}

// IsEmpty reports whether data holds nothing but JSON whitespace: an
// optional body that was left out.
func IsEmpty(data []byte) bool {
	return len(bytes.Trim(data, " \t\r\n")) == 0
}

// Check validates data as one strict JSON value of any shape (see the
// package comment), without decoding it: for opaque payloads.
func Check(data []byte) error {
	if IsEmpty(data) {
		return &Error{Problem: "no JSON value"}
	}
	dec := jsontext.NewDecoder(bytes.NewReader(data))
	for {
		tok, err := dec.ReadToken()
		if err != nil {
			return syntaxError(dec, err)
		}
		if err := checkToken(dec, tok); err != nil {
			return err
		}
		if dec.StackDepth() == 0 {
			break
		}
	}
	at := int(dec.InputOffset())
	if _, err := dec.ReadToken(); err != io.EOF {
		rest := bytes.TrimLeft(data[at:], " \t\r\n")
		return &Error{Offset: len(data) - len(rest), Problem: "unexpected data after the JSON value: " + quote(rest)}
	}
	return nil
}

// checkToken applies the project's own rules to one token.
func checkToken(dec *jsontext.Decoder, tok jsontext.Token) error {
	switch tok.Kind() {
	case '{', '[':
		if dec.StackDepth() > MaxDepth {
			return tokenError(dec, false, fmt.Sprintf("nested deeper than %d levels", MaxDepth))
		}
	case '"':
		if strings.IndexByte(tok.String(), 0) >= 0 {
			// A name is reported at its object, a value at its member.
			_, n := dec.StackIndex(dec.StackDepth())
			k, _ := dec.StackIndex(dec.StackDepth())
			return tokenError(dec, k == '{' && n%2 == 1, `\u0000 (NUL) is not allowed in a string`)
		}
	case '0':
		return checkNumber(dec, tok.String())
	}
	return nil
}

func checkNumber(dec *jsontext.Decoder, num string) error {
	if len(num) > MaxNumberLen {
		return tokenError(dec, false, fmt.Sprintf("number longer than %d characters", MaxNumberLen))
	}
	if i := strings.IndexAny(num, "eE"); i >= 0 {
		exp := strings.TrimLeft(strings.TrimLeft(num[i+1:], "+-"), "0")
		if n, err := strconv.Atoi(exp); len(exp) > 4 || (err == nil && n > MaxExponent) {
			return tokenError(dec, false, fmt.Sprintf("number %s has an exponent beyond ±%d", quote([]byte(num)), MaxExponent))
		}
	}
	return nil
}

// tokenError is an *Error at the token just read, at its parent when
// parent (an object's member name).
func tokenError(dec *jsontext.Decoder, parent bool, problem string) error {
	ptr := dec.StackPointer()
	if parent {
		ptr = ptr.Parent()
	}
	return &Error{Path: stackPath(dec, ptr), Offset: int(dec.InputOffset()), Problem: problem}
}

// stackPath turns ptr, a pointer into the decoder's current stack, into a
// Path: a token below an array is an index, below an object a name.
func stackPath(dec *jsontext.Decoder, ptr jsontext.Pointer) []any {
	var path []any
	level := 1
	for tok := range ptr.Tokens() {
		k, _ := dec.StackIndex(level)
		if i, err := strconv.Atoi(tok); err == nil && k == '[' {
			path = append(path, i)
		} else {
			path = append(path, tok)
		}
		level++
	}
	return path
}

// syntaxError words an error of the decoder.
func syntaxError(dec *jsontext.Decoder, err error) error {
	var se *jsontext.SyntacticError
	if !errors.As(err, &se) {
		if errors.Is(err, io.ErrUnexpectedEOF) || err == io.EOF {
			return &Error{Path: stackPath(dec, dec.StackPointer()), Offset: int(dec.InputOffset()), Problem: "unexpected end of JSON"}
		}
		return &Error{Problem: err.Error()}
	}
	ptr, problem := se.JSONPointer, strings.TrimPrefix(se.Err.Error(), "jsontext: ")
	switch {
	case errors.Is(se.Err, jsontext.ErrDuplicateName):
		// Reported at the object that holds the name twice.
		ptr, problem = ptr.Parent(), fmt.Sprintf("duplicate key %s", strconv.Quote(short(ptr.LastToken())))
	case errors.Is(se.Err, io.ErrUnexpectedEOF):
		problem = "unexpected end of JSON"
	case strings.Contains(problem, "surrogate"):
		problem = "lone UTF-16 surrogate: " + problem
	case strings.Contains(problem, "expecting non-control character"):
		problem = "control character in a string (escape it): " + problem
	}
	return &Error{Path: stackPath(dec, ptr), Offset: int(se.ByteOffset), Problem: problem}
}

// Decode checks data strictly and decodes it into v, which must be a
// non-nil pointer. Objects decoded into structs must use the exact field
// names (the json tag, or the Go name without one) and no others.
func Decode(data []byte, v any) error {
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.IsNil() {
		return fmt.Errorf("jsonbody: Decode needs a non-nil pointer, got %T", v)
	}
	if err := Check(data); err != nil {
		return err
	}
	// A top-level null would leave v unchanged; a body must say something.
	if t := indirect(rv.Type().Elem()); bytes.Equal(bytes.TrimSpace(data), []byte("null")) &&
		(t.Kind() == reflect.Struct || t.Kind() == reflect.Slice) {
		return &Error{Offset: bytes.IndexByte(data, 'n'), Problem: "must be a JSON " + shape(t) + ", got null"}
	}
	err := json.Unmarshal(data, v, json.RejectUnknownMembers(true))
	if err == nil {
		return checkNulls(data, rv.Type().Elem())
	}
	var se *json.SemanticError
	if !errors.As(err, &se) {
		return err
	}
	path, parent := typePath(rv.Type().Elem(), se.JSONPointer)
	e := &Error{Path: path, Offset: int(se.ByteOffset)}
	switch {
	case errors.Is(se.Err, json.ErrUnknownName):
		e.Problem = unknownField(parent, se.JSONPointer.LastToken())
	case se.GoType == reflect.TypeFor[time.Time]():
		e.Problem = `must be an RFC 3339 time such as "2026-05-01T12:00:00Z"`
	case se.GoType != nil && se.JSONKind != 0:
		e.Problem = fmt.Sprintf("must be %s, got %s", describe(se.GoType), kindName(se.JSONKind, se.JSONValue))
	default:
		e.Problem = strings.TrimPrefix(err.Error(), "json: ")
	}
	return e
}

// Given returns the member names each object of data gives: one set for
// an object, one per element for an array (nil for an element that is
// not an object), nil for anything else. data must have passed Check.
// It tells a field left out from one given with its zero value, which a
// decoded Go value cannot: a caller refuses the values that mean "left
// out" when given (docs/reference.md, one rule for optional values).
func Given(data []byte) []map[string]bool {
	dec := jsontext.NewDecoder(bytes.NewReader(data))
	tok, err := dec.ReadToken()
	if err != nil {
		return nil
	}
	switch tok.Kind() {
	case '{':
		return []map[string]bool{members(dec)}
	case '[':
		var out []map[string]bool
		for k := dec.PeekKind(); k != ']' && k != 0; k = dec.PeekKind() {
			if k != '{' {
				if dec.SkipValue() != nil {
					return out
				}
				out = append(out, nil)
				continue
			}
			if _, err := dec.ReadToken(); err != nil {
				return out
			}
			out = append(out, members(dec))
		}
		return out
	}
	return nil
}

// members reads the rest of an object whose '{' dec has read, and returns
// its member names.
func members(dec *jsontext.Decoder) map[string]bool {
	names := map[string]bool{}
	for dec.PeekKind() == '"' {
		tok, err := dec.ReadToken()
		if err != nil {
			return names
		}
		names[tok.String()] = true // before the next read: it reuses the token's buffer
		if dec.SkipValue() != nil {
			return names
		}
	}
	_, _ = dec.ReadToken() // '}'
	return names
}

// checkNulls refuses a null below the top level of data that t, the type
// data was decoded into, would read as a zero value (see the package
// comment). data has passed Check and decoded into t.
func checkNulls(data []byte, t reflect.Type) error {
	dec := jsontext.NewDecoder(bytes.NewReader(data))
	for {
		tok, err := dec.ReadToken()
		if err != nil {
			return nil // the end: data is one valid JSON value
		}
		if tok.Kind() != 'n' || dec.StackDepth() == 0 {
			continue
		}
		ptr := dec.StackPointer()
		field, opaque := typeAt(t, ptr)
		if opaque {
			continue
		}
		problem := "must not be null"
		if field {
			problem = "must not be null (leave the field out instead)"
		}
		return &Error{Path: stackPath(dec, ptr), Offset: int(dec.InputOffset()) - len("null"), Problem: problem}
	}
}

// Opaque JSON types: null is one of their values.
var (
	rawMessageType = reflect.TypeFor[stdjson.RawMessage]()
	jsonValueType  = reflect.TypeFor[jsontext.Value]()
)

func isOpaque(t reflect.Type) bool {
	return t == rawMessageType || t == jsonValueType || t.Kind() == reflect.Interface
}

// typeAt follows ptr through t and reports whether it ends at a struct
// field, and whether it ends in opaque JSON (or at a place t does not
// describe, which Unmarshal then did not decode into a typed value).
func typeAt(t reflect.Type, ptr jsontext.Pointer) (field, opaque bool) {
	for tok := range ptr.Tokens() {
		t = indirect(t)
		if isOpaque(t) {
			return false, true
		}
		field = false
		switch t.Kind() {
		case reflect.Slice, reflect.Array, reflect.Map:
			t = t.Elem()
		case reflect.Struct:
			f, ok := structFields(t)[tok]
			if !ok {
				return false, true
			}
			t, field = f, true
		default:
			return false, true
		}
	}
	return field, isOpaque(indirect(t))
}

// typePath turns ptr into a Path by walking the Go type it points into (a
// token is an index below a slice or array, a name below a struct or map)
// and returns the type of the value that holds the last token.
func typePath(t reflect.Type, ptr jsontext.Pointer) (path []any, parent reflect.Type) {
	for tok := range ptr.Tokens() {
		t = indirect(t)
		parent = t
		switch t.Kind() {
		case reflect.Slice, reflect.Array:
			i, _ := strconv.Atoi(tok)
			path, t = append(path, i), t.Elem()
		case reflect.Map:
			path, t = append(path, tok), t.Elem()
		case reflect.Struct:
			path = append(path, tok)
			if f, ok := structFields(t)[tok]; ok {
				t = f
			}
		default:
			path = append(path, tok)
		}
	}
	return path, parent
}

func unknownField(t reflect.Type, key string) string {
	if t != nil && t.Kind() == reflect.Struct {
		for name := range structFields(t) {
			if strings.EqualFold(name, key) {
				return fmt.Sprintf("unknown field %s: field names are case-sensitive, did you mean %q?", strconv.Quote(short(key)), name)
			}
		}
	}
	return fmt.Sprintf("unknown field %s", strconv.Quote(short(key)))
}

// structFields maps the JSON names of t's exported fields to their types.
func structFields(t reflect.Type) map[string]reflect.Type {
	fields := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name := f.Name
		tagName := ""
		if tag, ok := f.Tag.Lookup("json"); ok {
			tagName, _, _ = strings.Cut(tag, ",")
			if tagName == "-" {
				continue
			}
			if tagName != "" {
				name = tagName
			}
		}
		if f.Anonymous && tagName == "" && indirect(f.Type).Kind() == reflect.Struct {
			// An embedded struct without a name is inlined: its fields are
			// the outer object's.
			maps.Copy(fields, structFields(indirect(f.Type)))
			continue
		}
		fields[name] = f.Type
	}
	return fields
}

func kindName(k jsontext.Kind, v jsontext.Value) string {
	switch k {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case '0':
		return "the number " + quote(v)
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return k.String()
}

func describe(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return fmt.Sprintf("an integer that fits in %s", t.Kind())
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "true or false"
	case reflect.Struct, reflect.Map:
		return "a JSON object"
	case reflect.Slice, reflect.Array:
		return "a JSON array"
	}
	return "a " + t.String()
}

func indirect(t reflect.Type) reflect.Type {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

func shape(t reflect.Type) string {
	if t.Kind() == reflect.Slice {
		return "array"
	}
	return "object"
}

// quote shows at most 16 bytes of the input, so that errors do not echo a
// whole body.
func quote(b []byte) string {
	if len(b) > 16 {
		return strconv.Quote(string(b[:16])) + "…"
	}
	return strconv.Quote(string(b))
}

func short(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}
