// Package handlerctx carries, in a handler's context, what runs the
// handler: the client whose runner claimed the task, or a test's stand-in
// (package shardruntest). shardrun.CompleteTx and AddWorkerTx handlers
// find it there, so that a handler needs no reference to its client.
package handlerctx

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/shardrun/shardrun/tasks"
)

// Runtime is what a handler's context carries.
type Runtime interface {
	// CompleteTx records the completion of t, the attempt the handler
	// runs, inside tx.
	CompleteTx(ctx context.Context, tx pgx.Tx, t *tasks.Task) error
	// Begin starts the transaction an AddWorkerTx handler runs in.
	Begin(ctx context.Context) (pgx.Tx, error)
}

type key struct{}

// With returns ctx carrying r.
func With(ctx context.Context, r Runtime) context.Context { return context.WithValue(ctx, key{}, r) }

// From returns the runtime ctx carries, if any.
func From(ctx context.Context) (Runtime, bool) {
	r, ok := ctx.Value(key{}).(Runtime)
	return r, ok
}
