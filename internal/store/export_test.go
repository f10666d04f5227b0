package store

// SetBetweenListStatements makes a listing call f between its page and its
// cursor statement, for the test that both see one snapshot; the returned
// function restores the default.
func SetBetweenListStatements(f func()) (restore func()) {
	betweenListStatements = f
	return func() { betweenListStatements = nil }
}
