// Package jsonbody decodes JSON that comes from outside the process (HTTP
// request bodies, task payloads) strictly, so that no input means two things:
//
//   - the text is one JSON value (RFC 8259) and nothing else: no trailing
//     data, not even a second value;
//   - it is valid UTF-8, checked on the raw bytes (encoding/json silently
//     replaces invalid bytes with U+FFFD, so a key would hash to another
//     shard than the one its producer computed);
//   - no object has the same key twice, at any depth (encoding/json keeps
//     the last one, PostgreSQL's jsonb too, so the first value vanishes);
//   - no string holds \u0000 or a lone UTF-16 surrogate escape (PostgreSQL
//     refuses the first in text and jsonb, the second in jsonb; encoding/json
//     turns a lone surrogate into U+FFFD);
//   - numbers have at most MaxNumberLen characters and an exponent within
//     ±MaxExponent, well inside what PostgreSQL's numeric stores;
//   - nesting is at most MaxDepth deep;
//   - when decoding into a struct, every key names a field exactly: field
//     names are case-sensitive (encoding/json matches them case-insensitively)
//     and unknown fields are refused.
//
// Errors are *Error values that say where (the path of keys and indices,
// and the byte offset) and what, without echoing more than a short quote of
// the input.
package jsonbody

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"time"
	"unicode/utf16"
	"unicode/utf8"
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
	_, err := parse(data)
	return err
}

// Decode checks data strictly and decodes it into v, which must be a
// non-nil pointer. Objects decoded into structs must use the exact field
// names (the json tag, or the Go name without one) and no others; nested
// values are decoded with encoding/json one field at a time, so every error
// names its path. Types that implement json.Unmarshaler (time.Time,
// json.RawMessage) decode their value as a whole. Embedded structs are not
// supported.
func Decode(data []byte, v any) error {
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.IsNil() {
		return fmt.Errorf("jsonbody: Decode needs a non-nil pointer, got %T", v)
	}
	root, err := parse(data)
	if err != nil {
		return err
	}
	d := decoder{data: data}
	// A top-level null would leave v unchanged; a body must say something.
	if root.kind == kNull {
		if t := indirect(rv.Type().Elem()); t.Kind() == reflect.Struct || t.Kind() == reflect.Slice {
			return &Error{Offset: root.start, Problem: "must be a JSON " + shape(t) + ", got null"}
		}
	}
	return d.decode(root, rv.Elem(), nil)
}

// value kinds of the parse tree
const (
	kObject = iota + 1
	kArray
	kString
	kNumber
	kBool
	kNull
)

var kindNames = map[int]string{kObject: "an object", kArray: "an array", kString: "a string",
	kNumber: "a number", kBool: "a boolean", kNull: "null"}

// node is one parsed value: its span in the text and, for objects and
// arrays, its members.
type node struct {
	kind       int
	start, end int
	keys       []string // objects: unescaped keys, in order
	kids       []*node  // objects: member values; arrays: elements
}

type parser struct {
	data []byte
	pos  int
	path []any
}

func parse(data []byte) (*node, error) {
	p := &parser{data: data}
	p.ws()
	if p.pos == len(data) {
		return nil, &Error{Offset: 0, Problem: "no JSON value"}
	}
	n, err := p.value(0)
	if err != nil {
		return nil, err
	}
	p.ws()
	if p.pos != len(data) {
		return nil, &Error{Offset: p.pos, Problem: "unexpected data after the JSON value: " + quote(data[p.pos:])}
	}
	return n, nil
}

func (p *parser) fail(format string, args ...any) error {
	return &Error{Path: append([]any(nil), p.path...), Offset: p.pos, Problem: fmt.Sprintf(format, args...)}
}

func (p *parser) ws() {
	for p.pos < len(p.data) {
		switch p.data[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

func (p *parser) value(depth int) (*node, error) {
	if p.pos >= len(p.data) {
		return nil, p.fail("unexpected end of JSON")
	}
	switch c := p.data[p.pos]; {
	case c == '{':
		return p.object(depth + 1)
	case c == '[':
		return p.array(depth + 1)
	case c == '"':
		start := p.pos
		if _, err := p.str(); err != nil {
			return nil, err
		}
		return &node{kind: kString, start: start, end: p.pos}, nil
	case c == '-' || (c >= '0' && c <= '9'):
		return p.number()
	case c == 't':
		return p.literal("true", kBool)
	case c == 'f':
		return p.literal("false", kBool)
	case c == 'n':
		return p.literal("null", kNull)
	default:
		return nil, p.fail("invalid character %s looking for a value", quoteChar(p.data[p.pos:]))
	}
}

func (p *parser) literal(lit string, kind int) (*node, error) {
	start := p.pos
	if !bytes.HasPrefix(p.data[p.pos:], []byte(lit)) {
		return nil, p.fail("invalid literal %s (want %s)", quote(p.data[p.pos:]), lit)
	}
	p.pos += len(lit)
	return &node{kind: kind, start: start, end: p.pos}, nil
}

func (p *parser) object(depth int) (*node, error) {
	if depth > MaxDepth {
		return nil, p.fail("nested deeper than %d levels", MaxDepth)
	}
	n := &node{kind: kObject, start: p.pos}
	p.pos++ // {
	p.ws()
	if p.pos < len(p.data) && p.data[p.pos] == '}' {
		p.pos++
		n.end = p.pos
		return n, nil
	}
	seen := map[string]bool{}
	for {
		p.ws()
		if p.pos >= len(p.data) || p.data[p.pos] != '"' {
			if p.pos >= len(p.data) {
				return nil, p.fail("unexpected end of JSON in an object")
			}
			return nil, p.fail("invalid character %s looking for an object key", quoteChar(p.data[p.pos:]))
		}
		keyAt := p.pos
		key, err := p.str()
		if err != nil {
			return nil, err
		}
		if seen[key] {
			p.pos = keyAt
			return nil, p.fail("duplicate key %s", strconv.Quote(short(key)))
		}
		seen[key] = true
		p.ws()
		if p.pos >= len(p.data) || p.data[p.pos] != ':' {
			return nil, p.fail("expected ':' after object key %s", strconv.Quote(short(key)))
		}
		p.pos++
		p.ws()
		p.path = append(p.path, key)
		v, err := p.value(depth)
		if err != nil {
			return nil, err
		}
		p.path = p.path[:len(p.path)-1]
		n.keys = append(n.keys, key)
		n.kids = append(n.kids, v)
		p.ws()
		if p.pos >= len(p.data) {
			return nil, p.fail("unexpected end of JSON in an object")
		}
		switch p.data[p.pos] {
		case ',':
			p.pos++
		case '}':
			p.pos++
			n.end = p.pos
			return n, nil
		default:
			return nil, p.fail("invalid character %s after an object value (want , or })", quoteChar(p.data[p.pos:]))
		}
	}
}

func (p *parser) array(depth int) (*node, error) {
	if depth > MaxDepth {
		return nil, p.fail("nested deeper than %d levels", MaxDepth)
	}
	n := &node{kind: kArray, start: p.pos}
	p.pos++ // [
	p.ws()
	if p.pos < len(p.data) && p.data[p.pos] == ']' {
		p.pos++
		n.end = p.pos
		return n, nil
	}
	for i := 0; ; i++ {
		p.ws()
		p.path = append(p.path, i)
		v, err := p.value(depth)
		if err != nil {
			return nil, err
		}
		p.path = p.path[:len(p.path)-1]
		n.kids = append(n.kids, v)
		p.ws()
		if p.pos >= len(p.data) {
			return nil, p.fail("unexpected end of JSON in an array")
		}
		switch p.data[p.pos] {
		case ',':
			p.pos++
		case ']':
			p.pos++
			n.end = p.pos
			return n, nil
		default:
			return nil, p.fail("invalid character %s after an array element (want , or ])", quoteChar(p.data[p.pos:]))
		}
	}
}

// str scans a string at p.pos (which holds '"') and returns it unescaped.
func (p *parser) str() (string, error) {
	p.pos++ // opening quote
	var b []byte
	for {
		if p.pos >= len(p.data) {
			return "", p.fail("unexpected end of JSON in a string")
		}
		c := p.data[p.pos]
		switch {
		case c == '"':
			p.pos++
			return string(b), nil
		case c == '\\':
			r, err := p.escape()
			if err != nil {
				return "", err
			}
			b = utf8.AppendRune(b, r)
		case c < 0x20:
			return "", p.fail("control character %#02x in a string (escape it)", c)
		case c < utf8.RuneSelf:
			b = append(b, c)
			p.pos++
		default:
			r, size := utf8.DecodeRune(p.data[p.pos:])
			if r == utf8.RuneError && size == 1 {
				return "", p.fail("invalid UTF-8 (byte %#02x) in a string", c)
			}
			b = append(b, p.data[p.pos:p.pos+size]...)
			p.pos += size
		}
	}
}

// escape decodes the escape sequence at p.pos (which holds '\').
func (p *parser) escape() (rune, error) {
	if p.pos+1 >= len(p.data) {
		return 0, p.fail("unexpected end of JSON in an escape sequence")
	}
	switch c := p.data[p.pos+1]; c {
	case '"', '\\', '/':
		p.pos += 2
		return rune(c), nil
	case 'b', 'f', 'n', 'r', 't':
		p.pos += 2
		return rune("\b\f\n\r\t"[strings.IndexByte("bfnrt", c)]), nil
	case 'u':
	default:
		return 0, p.fail("invalid escape sequence %s", quote(p.data[p.pos:min(p.pos+2, len(p.data))]))
	}
	r, err := p.hex4()
	if err != nil {
		return 0, err
	}
	switch {
	case r == 0:
		return 0, p.fail(`\u0000 (NUL) is not allowed in a string`)
	case utf16.IsSurrogate(r) && r >= 0xdc00:
		return 0, p.fail(`lone UTF-16 surrogate \u%04x (a low surrogate must follow a high one)`, r)
	case utf16.IsSurrogate(r):
		at := p.pos
		if !bytes.HasPrefix(p.data[p.pos+6:], []byte(`\u`)) {
			return 0, p.fail(`lone UTF-16 surrogate \u%04x (a high surrogate must be followed by a low one)`, r)
		}
		p.pos += 6
		r2, err := p.hex4()
		if err != nil {
			return 0, err
		}
		if r2 < 0xdc00 || r2 > 0xdfff {
			p.pos = at
			return 0, p.fail(`lone UTF-16 surrogate \u%04x (a high surrogate must be followed by a low one)`, r)
		}
		p.pos += 6
		return utf16.DecodeRune(r, r2), nil
	}
	p.pos += 6
	return r, nil
}

// hex4 reads the four hex digits of the \u escape at p.pos.
func (p *parser) hex4() (rune, error) {
	if p.pos+6 > len(p.data) {
		return 0, p.fail(`incomplete \u escape`)
	}
	var r rune
	for _, c := range p.data[p.pos+2 : p.pos+6] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, p.fail(`invalid \u escape %s`, quote(p.data[p.pos:p.pos+6]))
		}
	}
	return r, nil
}

// number scans -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (p *parser) number() (*node, error) {
	start := p.pos
	digits := func() int {
		n := 0
		for p.pos < len(p.data) && p.data[p.pos] >= '0' && p.data[p.pos] <= '9' {
			p.pos++
			n++
		}
		return n
	}
	if p.data[p.pos] == '-' {
		p.pos++
	}
	intStart := p.pos
	if n := digits(); n == 0 {
		return nil, p.fail("invalid number %s", quote(p.data[start:]))
	} else if n > 1 && p.data[intStart] == '0' {
		p.pos = intStart
		return nil, p.fail("invalid number %s: leading zero", quote(p.data[start:]))
	}
	if p.pos < len(p.data) && p.data[p.pos] == '.' {
		p.pos++
		if digits() == 0 {
			return nil, p.fail("invalid number %s: no digits after the point", quote(p.data[start:]))
		}
	}
	if p.pos < len(p.data) && (p.data[p.pos] == 'e' || p.data[p.pos] == 'E') {
		p.pos++
		if p.pos < len(p.data) && (p.data[p.pos] == '+' || p.data[p.pos] == '-') {
			p.pos++
		}
		expStart := p.pos
		if digits() == 0 {
			return nil, p.fail("invalid number %s: no digits in the exponent", quote(p.data[start:]))
		}
		exp := bytes.TrimLeft(p.data[expStart:p.pos], "0")
		if len(exp) > 4 || (len(exp) > 0 && mustAtoi(exp) > MaxExponent) {
			return nil, p.fail("number %s has an exponent beyond ±%d", quote(p.data[start:p.pos]), MaxExponent)
		}
	}
	if p.pos-start > MaxNumberLen {
		return nil, p.fail("number longer than %d characters", MaxNumberLen)
	}
	return &node{kind: kNumber, start: start, end: p.pos}, nil
}

func mustAtoi(b []byte) int {
	n, _ := strconv.Atoi(string(b))
	return n
}

// quote shows at most 16 bytes of the input, so that errors do not echo a
// whole body.
func quote(b []byte) string {
	if len(b) > 16 {
		return strconv.Quote(string(b[:16])) + "…"
	}
	return strconv.Quote(string(b))
}

func quoteChar(b []byte) string {
	if len(b) == 0 {
		return "(end)"
	}
	r, _ := utf8.DecodeRune(b)
	if r == utf8.RuneError {
		return fmt.Sprintf("%#02x", b[0])
	}
	return strconv.QuoteRune(r)
}

func short(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// decoder decodes a parse tree into Go values.
type decoder struct{ data []byte }

var unmarshalerType = reflect.TypeFor[json.Unmarshaler]()

func (d *decoder) errAt(n *node, path []any, format string, args ...any) error {
	return &Error{Path: append([]any(nil), path...), Offset: n.start, Problem: fmt.Sprintf(format, args...)}
}

func (d *decoder) decode(n *node, v reflect.Value, path []any) error {
	t := v.Type()
	if reflect.PointerTo(t).Implements(unmarshalerType) {
		return d.leaf(n, v, path)
	}
	switch t.Kind() {
	case reflect.Pointer:
		if n.kind == kNull {
			v.SetZero()
			return nil
		}
		if v.IsNil() {
			v.Set(reflect.New(t.Elem()))
		}
		return d.decode(n, v.Elem(), path)
	case reflect.Struct:
		if n.kind == kNull {
			return nil
		}
		if n.kind != kObject {
			return d.errAt(n, path, "must be a JSON object, got %s", kindNames[n.kind])
		}
		fields := structFields(t)
		for i, key := range n.keys {
			fi, ok := fields[key]
			if !ok {
				return d.unknownField(n.kids[i], append(path, key), key, fields)
			}
			if err := d.decode(n.kids[i], v.FieldByIndex(fi), append(path, key)); err != nil {
				return err
			}
		}
		return nil
	case reflect.Slice:
		if t.Elem().Kind() == reflect.Uint8 { // []byte: base64 string
			return d.leaf(n, v, path)
		}
		if n.kind == kNull {
			v.SetZero()
			return nil
		}
		if n.kind != kArray {
			return d.errAt(n, path, "must be a JSON array, got %s", kindNames[n.kind])
		}
		s := reflect.MakeSlice(t, len(n.kids), len(n.kids))
		for i, kid := range n.kids {
			if err := d.decode(kid, s.Index(i), append(path, i)); err != nil {
				return err
			}
		}
		v.Set(s)
		return nil
	case reflect.Map:
		if t.Key().Kind() != reflect.String {
			return d.leaf(n, v, path)
		}
		if n.kind == kNull {
			v.SetZero()
			return nil
		}
		if n.kind != kObject {
			return d.errAt(n, path, "must be a JSON object, got %s", kindNames[n.kind])
		}
		if v.IsNil() {
			v.Set(reflect.MakeMapWithSize(t, len(n.keys)))
		}
		for i, key := range n.keys {
			e := reflect.New(t.Elem()).Elem()
			if err := d.decode(n.kids[i], e, append(path, key)); err != nil {
				return err
			}
			v.SetMapIndex(reflect.ValueOf(key).Convert(t.Key()), e)
		}
		return nil
	default:
		return d.leaf(n, v, path)
	}
}

func (d *decoder) unknownField(n *node, path []any, key string, fields map[string][]int) error {
	for name := range fields {
		if strings.EqualFold(name, key) {
			return d.errAt(n, path, "unknown field %s: field names are case-sensitive, did you mean %q?", strconv.Quote(short(key)), name)
		}
	}
	return d.errAt(n, path, "unknown field %s", strconv.Quote(short(key)))
}

// leaf decodes one value with encoding/json (the text is already checked).
func (d *decoder) leaf(n *node, v reflect.Value, path []any) error {
	err := json.Unmarshal(d.data[n.start:n.end], v.Addr().Interface())
	if err == nil {
		return nil
	}
	if v.Type() == reflect.TypeFor[time.Time]() {
		return d.errAt(n, path, "must be an RFC 3339 time such as \"2026-05-01T12:00:00Z\"")
	}
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		return d.errAt(n, path, "must be %s, got %s", describe(te.Type), te.Value)
	}
	return d.errAt(n, path, "%s", strings.TrimPrefix(err.Error(), "json: "))
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

// structFields maps the JSON names of t's exported fields to their indices.
func structFields(t reflect.Type) map[string][]int {
	fields := map[string][]int{}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() || f.Anonymous {
			continue
		}
		name := f.Name
		if tag, ok := f.Tag.Lookup("json"); ok {
			tagName, _, _ := strings.Cut(tag, ",")
			if tagName == "-" {
				continue
			}
			if tagName != "" {
				name = tagName
			}
		}
		fields[name] = f.Index
	}
	return fields
}
