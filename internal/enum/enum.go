// Package enum names the values of the module's small integer enums
// (claims.Outcome, shard.EventKind, the shard ledger's term states): one
// table of names per type, and one rule for a value the table does not
// name.
package enum

import "fmt"

// Name returns names[v], or "typ(v)" when v has no name there.
func Name[T ~int](v T, names []string, typ string) string {
	if int(v) >= 0 && int(v) < len(names) && names[v] != "" {
		return names[v]
	}
	return fmt.Sprintf("%s(%d)", typ, int(v))
}
