package tasks

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// A window of creation times must be non-empty, and each bound before the
// year 10000; the error names the bound at fault.
func TestFilterCreatedWindow(t *testing.T) {
	now := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		f     Filter
		field string
	}{
		{Filter{CreatedSince: now}, ""},
		{Filter{CreatedSince: now, CreatedBefore: now.Add(time.Nanosecond)}, ""},
		{Filter{CreatedSince: now, CreatedBefore: now}, "created_since"},
		{Filter{CreatedSince: now.Add(time.Hour), CreatedBefore: now}, "created_since"},
		{Filter{CreatedSince: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}, "created_since"},
	} {
		err := tc.f.Check(16)
		var fe *FieldError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("%+v: %v", tc.f, err)
		case tc.field != "" && (!errors.As(err, &fe) || fe.Field != tc.field):
			t.Errorf("%+v: got %v, want an error about %s", tc.f, err, tc.field)
		}
	}
	if (Filter{CreatedSince: now}).Empty() {
		t.Error("a filter with only created_since is not empty")
	}
	err := Filter{CreatedSince: now, CreatedBefore: now}.Check(16)
	if err == nil || !strings.Contains(err.Error(), "2026-11-25T12:00:00Z") {
		t.Errorf("the message names the bounds: %v", err)
	}
}
