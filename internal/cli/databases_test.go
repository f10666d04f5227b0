package cli

import (
	"io"
	"io/fs"
	"strings"
	"testing"
)

func databaseSet(files map[string]string) (*FlagSet, *[]Database) {
	f := NewFlagSet("t", "")
	var dbs []Database
	f.Databases(&dbs)
	f.ReadFile = func(name string, _ int) ([]byte, error) {
		if v, ok := files[name]; ok {
			return []byte(v), nil
		}
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	return f, &dbs
}

func names(dbs []Database) string {
	var out []string
	for _, d := range dbs {
		out = append(out, d.Name+"="+d.URL)
	}
	return strings.Join(out, " ")
}

// The databases come in the order given, across --database and
// --database-file, or from the variables when neither flag is given;
// every error is one line naming the flag or variable and the database,
// never the URL's password.
func TestDatabaseFlags(t *testing.T) {
	files := map[string]string{"/run/second": "postgres://u:s3cret@b/db\n", "/run/empty": "\n"}
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string // the databases, or the error's text
		err  bool
	}{
		{[]string{"--database", "main=postgres://u:s3cret@a/db", "--database-file", "second=/run/second"}, nil,
			"main=postgres://u:s3cret@a/db second=postgres://u:s3cret@b/db", false},
		{[]string{"--database-file", "second=/run/second", "--database", "main=postgres://a/db"}, nil,
			"second=postgres://u:s3cret@b/db main=postgres://a/db", false},
		{nil, map[string]string{DatabasesEnv: "main=postgres://a/db\n  second=postgres://b/db"}, "main=postgres://a/db second=postgres://b/db", false},
		{nil, map[string]string{DatabasesEnv: "main=postgres://a/db", DatabasesFileEnv: "second=/run/second"},
			"main=postgres://a/db second=postgres://u:s3cret@b/db", false},
		// The command line wins over both variables.
		{[]string{"--database", "x=postgres://x/db"}, map[string]string{DatabasesEnv: "main=postgres://a/db", DatabasesFileEnv: "second=/run/second"},
			"x=postgres://x/db", false},
		{[]string{"--database", "host=h user=u"}, nil, "host=h user=u", false}, // a key=value string: NAME is "host"
		{[]string{"--database", "postgres://u:s3cret@a/db"}, nil, "--database: must be NAME=URL", true},
		{[]string{"--database", "main="}, nil, "--database: must be NAME=URL", true},
		{nil, map[string]string{DatabasesEnv: "postgres://u:s3cret@a/db"}, DatabasesEnv + ": must be NAME=URL", true},
		{[]string{"--database", "Main=postgres://u:s3cret@a/db"}, nil, `--database: the database name "Main"`, true},
		{[]string{"--database", "main=postgres://a/db", "--database", "main=postgres://u:s3cret@b/db"}, nil, "--database: database main is given twice", true},
		{[]string{"--database-file", "second=/run/missing"}, nil, "--database-file: database second: reading the secret file", true},
		{[]string{"--database-file", "second=/run/empty"}, nil, "--database-file: database second: /run/empty is empty", true},
		{nil, map[string]string{DatabasesFileEnv: "second=/run/missing"}, DatabasesFileEnv + ": database second", true},
	} {
		f, dbs := databaseSet(files)
		err := f.Parse(tc.args, func(k string) string { return tc.env[k] }, io.Discard)
		switch {
		case tc.err && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%v %v: %v, want an error with %q", tc.args, tc.env, err, tc.want)
		case tc.err && (strings.Contains(err.Error(), "s3cret") || strings.Contains(err.Error(), "\n")):
			t.Errorf("%v %v: the error shows the password or is not one line: %v", tc.args, tc.env, err)
		case !tc.err && (err != nil || names(*dbs) != tc.want):
			t.Errorf("%v %v: %q %v, want %q", tc.args, tc.env, names(*dbs), err, tc.want)
		}
	}
}

func TestDatabasesOnCommandLine(t *testing.T) {
	f, _ := databaseSet(map[string]string{"/run/second": "postgres://b/db"})
	if err := f.Parse([]string{"--database", "main=postgres://a/db", "--database-file", "second=/run/second"}, func(string) string { return "" }, io.Discard); err != nil {
		t.Fatal(err)
	}
	if got := f.DatabasesOnCommandLine(); len(got) != 1 || got[0].Name != "main" {
		t.Errorf("on the command line: %v", got)
	}
	if !f.Given(DatabaseFlag) || f.Source(DatabaseFileFlag) != "--database-file" {
		t.Errorf("given: %v, source %q", f.Given(DatabaseFlag), f.Source(DatabaseFileFlag))
	}
}

func TestDatabaseList(t *testing.T) {
	got, err := DatabaseList("postgres://a/db", []Database{{"second", "postgres://b/db", "--database"}})
	if err != nil || names(got) != "main=postgres://a/db second=postgres://b/db" {
		t.Errorf("--database-url and --database: %q %v", names(got), err)
	}
	if _, err := DatabaseList("postgres://a/db", []Database{{"main", "postgres://u:s3cret@b/db", "--database"}}); err == nil ||
		!strings.Contains(err.Error(), "database main") || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("main given twice: %v", err)
	}
	if got := (Database{"main", "postgres://u:s3cret@a/db", ""}).String(); got != "main" {
		t.Errorf("a Database prints as %q", got)
	}
	if got[0].Where() != "--database-url (DATABASE_URL)" || got[1].Where() != "--database second" {
		t.Errorf("where: %q, %q", got[0].Where(), got[1].Where())
	}
}
