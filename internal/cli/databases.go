package cli

import (
	"flag"
	"fmt"
	"regexp"
	"strings"
)

// Database is one of the cluster's databases as a process is given it:
// its name in the cluster's map and its URL. Its String is the name
// only: a Database printed in a log line or an error shows no URL.
type Database struct {
	Name string
	URL  string
	// From says where it was given ("--database", "--database-file",
	// "SHARDRUN_DATABASES", "--database-url (DATABASE_URL)"), for errors;
	// empty for a database a program gives in Go.
	From string
}

// String is the database's name.
func (d Database) String() string { return d.Name }

// Where names the database and where it was given, for an error: a
// one-line message naming the flag and the database, never its URL.
func (d Database) Where() string {
	switch {
	case d.From == "":
		return "database " + d.Name
	case strings.HasPrefix(d.From, "--database-url"):
		return d.From
	}
	return d.From + " " + d.Name
}

// MainDatabase is the name of the database --database-url gives: the
// one-database form of --database.
const MainDatabase = "main"

// MaxDatabases bounds the databases of a cluster: every process opens a
// pool on each (and a runner a LISTEN connection), and task ids take
// every 1,024th value from each database's slot.
const MaxDatabases = 64

// The flags and variables of the databases (FlagSet.Databases).
const (
	DatabaseFlag     = "database"
	DatabaseFileFlag = "database-file"
	DatabasesEnv     = "SHARDRUN_DATABASES"
	DatabasesFileEnv = "SHARDRUN_DATABASES_FILE"
)

var databaseName = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,62}$`)

// CheckDatabaseName checks the name of a database: a lowercase letter,
// then up to 62 lowercase letters, digits, '-' and '_'. It is what the
// cluster's map, the database's own record, the logs and GET
// /api/databases call it.
func CheckDatabaseName(name string) error {
	if !databaseName.MatchString(name) {
		return fmt.Errorf("the database name %q must be a lowercase letter then up to 62 lowercase letters, digits, - and _", clip(name))
	}
	return nil
}

func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// dbEntry is one --database or --database-file as given, in order.
type dbEntry struct {
	name, value string
	file        bool
	from        string // --database, SHARDRUN_DATABASES, …
	cut         bool   // the entry had NAME=
}

// dbList is the flag.Value of --database and --database-file: both
// append to one list, so that the order given is kept across the two.
type dbList struct {
	entries *[]dbEntry
	file    bool
}

func (l dbList) String() string { return "" }

// Set records the entry; a malformed one is refused by Parse afterwards,
// since the flag package's own error would quote the value (a URL with its
// password).
func (l dbList) Set(v string) error {
	name, value, _ := strings.Cut(v, "=")
	flagName := DatabaseFlag
	if l.file {
		flagName = DatabaseFileFlag
	}
	*l.entries = append(*l.entries, dbEntry{name: name, value: value, file: l.file, from: "--" + flagName, cut: strings.Contains(v, "=")})
	return nil
}

// databases is what Databases declared: where the list goes and what
// was given.
type databases struct {
	p       *[]Database
	entries []dbEntry
	// onCommandLine are the databases whose URL was on the command line.
	onCommandLine []Database
}

// Databases declares the cluster's databases by name: --database
// NAME=URL and --database-file NAME=PATH (a file holding the URL, for
// secrets), each repeatable and kept in the order given, or, when
// neither is on the command line, SHARDRUN_DATABASES and
// SHARDRUN_DATABASES_FILE, each a list of NAME=URL (NAME=PATH) separated
// by spaces or newlines (a URL holds none; a key=value connection string
// goes by --database or a file). Parse fills p in the order given: the
// order of the map's databases when they create the cluster. Errors name
// the flag or the variable and the database, never the URL.
func (f *FlagSet) Databases(p *[]Database) {
	d := &databases{p: p}
	f.dbs = d
	f.fs.Var(dbList{entries: &d.entries}, DatabaseFlag, "a database of the cluster, NAME=URL; repeat it for each, in the map's order (--database-url URL is --database main=URL)")
	f.add(DatabaseFlag, DatabasesEnv)
	f.fs.Var(dbList{entries: &d.entries, file: true}, DatabaseFileFlag, "a database of the cluster, NAME=PATH of a file holding its URL (one trailing newline is trimmed); repeatable")
	f.add(DatabaseFileFlag, DatabasesFileEnv)
}

// parseDatabases reads the databases' variables when neither flag was
// on the command line, then checks every entry and reads the files.
func (f *FlagSet) parseDatabases(getenv func(string) string) error {
	d := f.dbs
	if d == nil {
		return nil
	}
	fromFlags := len(d.entries) > 0
	if !fromFlags {
		for _, env := range []string{DatabasesEnv, DatabasesFileEnv} {
			v, ok := lookup(getenv, env)
			if !ok {
				continue
			}
			for _, item := range strings.Fields(v) {
				name, value, cut := strings.Cut(item, "=")
				d.entries = append(d.entries, dbEntry{name: name, value: value, file: env == DatabasesFileEnv, from: env, cut: cut})
			}
			f.source[map[string]string{DatabasesEnv: DatabaseFlag, DatabasesFileEnv: DatabaseFileFlag}[env]] = env
		}
	}
	seen := map[string]string{}
	for _, e := range d.entries {
		if !e.cut || e.value == "" {
			form := "URL"
			if e.file {
				form = "PATH"
			}
			return fmt.Errorf("%s: must be NAME=%s (each entry separated by spaces in a variable); an entry %s", e.from, form, entryHint(e.name, e.cut))
		}
		if err := CheckDatabaseName(e.name); err != nil {
			return fmt.Errorf("%s: %v", e.from, err)
		}
		if by, dup := seen[e.name]; dup {
			return fmt.Errorf("%s: database %s is given twice (also by %s)", e.from, e.name, by)
		}
		seen[e.name] = e.from
		url := e.value
		if e.file {
			b, err := f.ReadFile(e.value, MaxSecretFile)
			switch {
			case err != nil:
				return fmt.Errorf("%s: database %s: reading the secret file: %v", e.from, e.name, err)
			case len(b) > MaxSecretFile:
				return fmt.Errorf("%s: %s is larger than %d bytes: not a secret file (database %s)", e.from, e.value, MaxSecretFile, e.name)
			}
			url = strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
			if url == "" {
				return fmt.Errorf("%s: database %s: %s is empty", e.from, e.name, e.value)
			}
		}
		db := Database{Name: e.name, URL: url, From: e.from}
		*d.p = append(*d.p, db)
		if e.from == "--"+DatabaseFlag {
			d.onCommandLine = append(d.onCommandLine, db)
		}
	}
	if len(*d.p) > MaxDatabases {
		return fmt.Errorf("%s: at most %d databases, got %d", d.entries[0].from, MaxDatabases, len(*d.p))
	}
	return nil
}

// entryHint describes a malformed list entry without its value (it may
// be a URL with a password).
func entryHint(name string, cut bool) string {
	if cut {
		return fmt.Sprintf("for %q has no value", clip(name))
	}
	return "has no NAME= (the whole entry is not shown: it may hold a password)"
}

// DatabasesOnCommandLine are the databases whose URL was given on the
// command line (--database), to warn about those with a password.
func (f *FlagSet) DatabasesOnCommandLine() []Database {
	if f.dbs == nil {
		return nil
	}
	return f.dbs.onCommandLine
}

// DatabaseList is the databases a process is given: --database-url (url,
// the database named main, first) and then the named ones, in order. The
// flag names main alone, or with --database flags for the others; main
// given both ways is an error.
func DatabaseList(url string, named []Database) ([]Database, error) {
	if url == "" {
		return named, nil
	}
	for _, d := range named {
		if d.Name == MainDatabase {
			return nil, fmt.Errorf("--database-url (DATABASE_URL) and --database %s=… both give the database %s: give it one way", MainDatabase, MainDatabase)
		}
	}
	return append([]Database{{Name: MainDatabase, URL: url, From: "--database-url (DATABASE_URL)"}}, named...), nil
}

var _ flag.Value = dbList{}
