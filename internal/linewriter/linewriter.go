// Package linewriter turns a byte stream (a child process's output) into
// whole lines for a callback.
package linewriter

import (
	"bytes"
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
