package store

// SetBetweenListStatements makes a listing call f between its page and its
// cursor statement, for the test that both see one snapshot; the returned
// function restores the default.
func SetBetweenListStatements(f func()) (restore func()) {
	betweenListStatements = f
	return func() { betweenListStatements = nil }
}

// ReadyQueuesSQL and ReadyQueuesArgs are ReadyQueues' statement and
// arguments, for the test that reads its plan.
var ReadyQueuesSQL = readyQueuesSQL

func ReadyQueuesArgs(shards []int, queues, kinds []string) []any {
	return readyQueuesArgs(shards, queues, kinds)
}

// Abandoning is m for a CopyShard that stops between the destination's
// commit and the source's, as a driver that crashed there.
func Abandoning(m ShardMove) ShardMove {
	m.abandon = true
	return m
}

// NotifierSent is how many notifications s's notifier has sent (after
// the commits of inserts that did not notify in their own transaction).
func NotifierSent(s *Store) int64 { return s.notify.sent.Load() }
