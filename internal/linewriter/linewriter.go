// Package linewriter turns a byte stream (a child process's output) into
// whole lines for a callback.
package linewriter

import (
	"bytes"
	"strings"
	"sync"
)

// Writer calls fn with each complete line written to it, without the
// newline. It is safe for concurrent use.
type Writer struct {
	mu  sync.Mutex
	buf []byte
	fn  func(line string)
}

// New returns a Writer that calls fn per line.
func New(fn func(line string)) *Writer { return &Writer{fn: fn} }

func (w *Writer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			return len(p), nil
		}
		w.fn(string(w.buf[:i]))
		w.buf = w.buf[i+1:]
	}
}

// Buffer keeps everything a child process writes, from its stdout and
// stderr at once, for showing when something went wrong.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns all that was written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Tail returns the last n lines of s.
func Tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
