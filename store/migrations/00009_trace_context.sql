-- OpenTelemetry traces (issue 27): the producer's trace context travels
-- with the task, so that the runner's spans for its claim, handler and
-- outcome join the trace that enqueued it.
--
-- trace_context holds the W3C trace context (traceparent and tracestate,
-- as a JSON object of the propagator's fields) of the enqueue span. It is
-- NULL for every task enqueued with tracing off: nothing extra is written,
-- and a NULL column costs a tuple no byte (tasks already has a null
-- bitmap). Adding a nullable column without a default changes only the
-- catalog: no rewrite, a brief ACCESS EXCLUSIVE lock. The insert trigger
-- files tasks by their own columns and needs no change; task_view does
-- not show the column (operators follow a task's trace in their tracing
-- backend, by the task id attribute).

-- +goose Up
ALTER TABLE tasks ADD COLUMN trace_context text;

-- +goose Down
ALTER TABLE tasks DROP COLUMN trace_context;
