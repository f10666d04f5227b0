// Package slogbridge lets a program that logs with log/slog receive
// shardrun's logs: an hclog.Logger (the project's own logger) that writes
// every record to a *slog.Logger, the hclog name as the attribute
// "logger" and the key/value pairs as attributes.
package slogbridge

import (
	"context"
	"io"
	"log"
	"log/slog"
	"strings"
	"sync/atomic"

	"github.com/hashicorp/go-hclog"
)

// LevelTrace is hclog's trace level in slog terms: below Debug.
const LevelTrace = slog.LevelDebug - 4

// New returns an hclog.Logger writing to l.
func New(l *slog.Logger) hclog.Logger {
	return &logger{l: l, level: new(atomic.Int32)}
}

type logger struct {
	l     *slog.Logger
	name  string
	args  []any
	level *atomic.Int32 // an hclog.Level set by SetLevel; NoLevel: slog decides
}

func toSlog(level hclog.Level) slog.Level {
	switch level {
	case hclog.Trace:
		return LevelTrace
	case hclog.Debug:
		return slog.LevelDebug
	case hclog.Warn:
		return slog.LevelWarn
	case hclog.Error:
		return slog.LevelError
	default:
		return slog.LevelInfo
	}
}

func (g *logger) enabled(level hclog.Level) bool {
	if min := hclog.Level(g.level.Load()); min != hclog.NoLevel && level < min {
		return false
	}
	return g.l.Enabled(context.Background(), toSlog(level))
}

// Log writes one record at level.
func (g *logger) Log(level hclog.Level, msg string, args ...any) {
	if !g.enabled(level) {
		return
	}
	attrs := make([]any, 0, len(g.args)+len(args)+2)
	if g.name != "" {
		attrs = append(attrs, "logger", g.name)
	}
	attrs = append(append(attrs, g.args...), args...)
	g.l.Log(context.Background(), toSlog(level), msg, attrs...)
}

func (g *logger) Trace(msg string, args ...any) { g.Log(hclog.Trace, msg, args...) }
func (g *logger) Debug(msg string, args ...any) { g.Log(hclog.Debug, msg, args...) }
func (g *logger) Info(msg string, args ...any)  { g.Log(hclog.Info, msg, args...) }
func (g *logger) Warn(msg string, args ...any)  { g.Log(hclog.Warn, msg, args...) }
func (g *logger) Error(msg string, args ...any) { g.Log(hclog.Error, msg, args...) }

func (g *logger) IsTrace() bool { return g.enabled(hclog.Trace) }
func (g *logger) IsDebug() bool { return g.enabled(hclog.Debug) }
func (g *logger) IsInfo() bool  { return g.enabled(hclog.Info) }
func (g *logger) IsWarn() bool  { return g.enabled(hclog.Warn) }
func (g *logger) IsError() bool { return g.enabled(hclog.Error) }

func (g *logger) ImpliedArgs() []any { return g.args }

func (g *logger) With(args ...any) hclog.Logger {
	c := *g
	c.args = append(append([]any(nil), g.args...), args...)
	return &c
}

func (g *logger) Name() string { return g.name }

func (g *logger) Named(name string) hclog.Logger {
	c := *g
	if c.name == "" {
		c.name = name
	} else {
		c.name += "." + name
	}
	return &c
}

func (g *logger) ResetNamed(name string) hclog.Logger {
	c := *g
	c.name = name
	return &c
}

func (g *logger) SetLevel(level hclog.Level) { g.level.Store(int32(level)) }

func (g *logger) GetLevel() hclog.Level {
	if level := hclog.Level(g.level.Load()); level != hclog.NoLevel {
		return level
	}
	for _, level := range []hclog.Level{hclog.Trace, hclog.Debug, hclog.Info, hclog.Warn} {
		if g.l.Enabled(context.Background(), toSlog(level)) {
			return level
		}
	}
	return hclog.Error
}

// StandardLogger is a *log.Logger whose lines are records at info.
func (g *logger) StandardLogger(opts *hclog.StandardLoggerOptions) *log.Logger {
	return log.New(g.StandardWriter(opts), "", 0)
}

// StandardWriter writes each line as a record at info.
func (g *logger) StandardWriter(*hclog.StandardLoggerOptions) io.Writer { return writer{g} }

type writer struct{ g *logger }

func (w writer) Write(p []byte) (int, error) {
	w.g.Info(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
