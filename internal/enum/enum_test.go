package enum

import "testing"

type color int

func TestName(t *testing.T) {
	names := []string{1: "red", 2: "green"}
	for _, tc := range []struct {
		v    color
		want string
	}{{1, "red"}, {2, "green"}, {0, "color(0)"}, {3, "color(3)"}, {-1, "color(-1)"}} {
		if got := Name(tc.v, names, "color"); got != tc.want {
			t.Errorf("Name(%d) = %q, want %q", tc.v, got, tc.want)
		}
	}
}
