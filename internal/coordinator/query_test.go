package coordinator

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shardrun/shardrun/tasks"
)

// requestWithQuery is a request whose query string is raw, byte for byte
// (httptest.NewRequest would refuse, or repair, what a client can send).
func requestWithQuery(raw string) *http.Request {
	return &http.Request{Method: "GET", URL: &url.URL{Path: "/", RawQuery: raw}}
}

// givenParams lists the parameters raw gives, read independently of the
// parser under test: each &-separated pair's name, unescaped. ok is false
// when a name does not unescape (the parser must then refuse raw).
func givenParams(raw string) (names []string, ok bool) {
	for pair := range strings.SplitSeq(raw, "&") {
		if pair == "" {
			continue
		}
		name, _, _ := strings.Cut(pair, "=")
		name, err := url.QueryUnescape(name)
		if err != nil {
			return nil, false
		}
		names = append(names, name)
	}
	return names, true
}

// mustNameAField fails t unless err is a *tasks.FieldError naming what is
// wrong: the answer's "field".
func mustNameAField(t *testing.T, raw string, err error) {
	t.Helper()
	var fe *tasks.FieldError
	if !errors.As(err, &fe) || fe.Field == "" {
		t.Fatalf("%q: %v, want a *tasks.FieldError naming a field", raw, err)
	}
}

// acceptedQuery checks what every accepted query must be: no pair was
// dropped (url.ParseQuery, the oracle, reads the same parameters, each
// given once and not empty), and returns its values.
func acceptedQuery(t *testing.T, raw string, allowed []string) url.Values {
	t.Helper()
	names, ok := givenParams(raw)
	std, err := url.ParseQuery(raw)
	if !ok || err != nil {
		t.Fatalf("%q accepted, but url.ParseQuery says %v", raw, err)
	}
	if len(names) != len(std) {
		t.Fatalf("%q accepted with %d pairs for %d parameters: one is given twice or was dropped", raw, len(names), len(std))
	}
	for _, name := range names {
		if !slices.Contains(allowed, name) || len(std[name]) != 1 || std[name][0] == "" {
			t.Fatalf("%q accepted with %s=%q", raw, name, std[name])
		}
	}
	return std
}

// FuzzFilterQuery feeds raw query strings to the parsers of the task
// listing, the count and the bulk operations, as their handlers call them
// (query, then parseListQuery or parseFilter). A query is refused with a
// *tasks.FieldError naming a field, or it is parsed into a filter that is
// exactly as narrow as it says: every parameter given is set, to its value
// (issue 34: priority=0 parsed to the filter's "any priority", and a pair
// r.URL.Query dropped left the rest of a bulk cancel's filter alone).
func FuzzFilterQuery(f *testing.F) {
	for _, s := range []string{
		"", "state=ready", "state=ready,dead&kind=noop&queue=q&priority=2", "shard=3&key=k&sequence_key=s",
		"created_before=2026-01-01T00:00:00Z&created_since=2025-01-01T00:00:00Z", "after=17&limit=5&order=desc",
		"priority=0", "priority=00", "priority=%2B0", "priority=-0", "after=0", "state=ready&priority=%G2",
		"queue=q;priority=2", "=x", "&&kind=a", "kind=a+b", "kind=a%00", "key=%FF", "kind=&kind=a", "state=ready,",
		"shard=%2B1", "limit=1000", "order=up", "created_before=0001-01-01T00:00:00Z", "colour=red",
	} {
		f.Add(s)
	}
	const shardCount = 16
	f.Fuzz(func(t *testing.T, raw string) {
		for _, allowed := range [][]string{listParams, countParams, filterParams} {
			q, err := query(requestWithQuery(raw), allowed)
			var req tasks.ListRequest
			if err == nil {
				if slices.Contains(allowed, "limit") {
					req, err = parseListQuery(q, shardCount)
				} else {
					req.Filter, req.After, err = parseFilter(q, shardCount)
				}
			}
			if err != nil {
				mustNameAField(t, raw, err)
				continue
			}
			std := acceptedQuery(t, raw, allowed)
			if len(std) > 0 && req.Filter.Empty() && req.After == 0 && req.Limit == 0 && !req.Desc && std.Get("order") != "asc" {
				t.Fatalf("%q parsed to an empty request", raw)
			}
			for name := range std {
				if !filterSays(req, name, std.Get(name)) {
					t.Fatalf("%q: %s=%q parsed to %+v", raw, name, std.Get(name), req)
				}
			}
			// Nothing set that the query does not say.
			for name, set := range map[string]bool{"state": req.States != nil, "kind": req.Kind != "", "shard": req.Shard != nil,
				"key": req.Key != "", "queue": req.Queue != "", "priority": req.Priority != 0, "sequence_key": req.SequenceKey != "",
				"created_before": !req.CreatedBefore.IsZero(), "created_since": !req.CreatedSince.IsZero(), "after": req.After != 0,
				"limit": req.Limit != 0, "order": req.Desc} {
				if set && !std.Has(name) {
					t.Fatalf("%q: %s set without being given: %+v", raw, name, req)
				}
			}
		}
	})
}

// filterSays reports whether req holds the parameter name given as v.
func filterSays(req tasks.ListRequest, name, v string) bool {
	n, nerr := strconv.ParseInt(v, 10, 64)
	at, terr := time.Parse(time.RFC3339Nano, v)
	switch name {
	case "state":
		parts := strings.Split(v, ",")
		if len(req.States) != len(parts) {
			return false
		}
		for i, p := range parts {
			if string(req.States[i]) != strings.TrimSpace(p) {
				return false
			}
		}
		return true
	case "kind":
		return req.Kind == v
	case "key":
		return req.Key == v
	case "queue":
		return req.Queue == v
	case "sequence_key":
		return req.SequenceKey == v
	case "shard":
		return req.Shard != nil && nerr == nil && int64(*req.Shard) == n
	case "priority":
		return req.Priority != 0 && nerr == nil && int64(req.Priority) == n
	case "created_before":
		return !req.CreatedBefore.IsZero() && terr == nil && req.CreatedBefore.Equal(at)
	case "created_since":
		return !req.CreatedSince.IsZero() && terr == nil && req.CreatedSince.Equal(at)
	case "after":
		return req.After != 0 && nerr == nil && req.After == n
	case "limit":
		return req.Limit != 0 && nerr == nil && int64(req.Limit) == n
	case "order":
		return req.Desc == (v == "desc")
	}
	return false
}

// FuzzListingQuery feeds raw query strings to the other listings' parsers
// (blocked sequences, schedules, queues), as their handlers call them: a
// query is refused naming a field, or every parameter given is read, to
// its value, and a cursor is text the database can take (issue 34: the
// blocked sequences' after=%00 reached PostgreSQL).
func FuzzListingQuery(f *testing.F) {
	for _, s := range []string{
		"", "after=k&limit=5", "after=%00", "after=%FF%FE", "after=", "after=a&after=b", "limit=0", "limit=1;after=a",
		"=x", "after=digest", "after=a%20b", "after=%G0", "colour=red", "limit=1001",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		// Blocked sequences: the cursor is a sequence key.
		if q, err := query(requestWithQuery(raw), sequenceParams); err != nil {
			mustNameAField(t, raw, err)
		} else if after, limit, err := parseSequenceQuery(q); err != nil {
			mustNameAField(t, raw, err)
		} else {
			std := acceptedQuery(t, raw, sequenceParams)
			if after != std.Get("after") || tasks.CheckKey("after", after) != nil || limit < 1 || limit > tasks.MaxListLimit ||
				std.Has("limit") && !sameNumber(std.Get("limit"), limit) || !std.Has("limit") && limit != tasks.DefaultListLimit {
				t.Fatalf("sequences %q: after %q limit %d", raw, after, limit)
			}
		}
		// Schedules: the cursor is a schedule name.
		if q, err := query(requestWithQuery(raw), scheduleParams); err != nil {
			mustNameAField(t, raw, err)
		} else if req, err := parseScheduleQuery(q); err != nil {
			mustNameAField(t, raw, err)
		} else {
			std := acceptedQuery(t, raw, scheduleParams)
			if req.After != std.Get("after") || req.Check() != nil || std.Has("limit") != (req.Limit != 0) ||
				std.Has("limit") && !sameNumber(std.Get("limit"), req.Limit) {
				t.Fatalf("schedules %q: %+v", raw, req)
			}
		}
		// Queues: idle, true or false.
		if q, err := query(requestWithQuery(raw), queueParams); err != nil {
			mustNameAField(t, raw, err)
		} else if idle, err := parseQueueQuery(q); err != nil {
			mustNameAField(t, raw, err)
		} else {
			std := acceptedQuery(t, raw, queueParams)
			if v := std.Get("idle"); std.Has("idle") != (idle != nil) || idle != nil && v != fmt.Sprint(*idle) {
				t.Fatalf("queues %q: idle %v", raw, idle)
			}
		}
	})
}

// sameNumber reports whether the decimal v is n.
func sameNumber(v string, n int) bool {
	m, err := strconv.Atoi(v)
	return err == nil && m == n
}
