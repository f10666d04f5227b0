// Command certgen makes the throwaway certificates of the compose
// deployment (docker-compose.yml): a CA, a certificate for each etcd
// member (its peer and client ports: etcdN, localhost, 127.0.0.1, so that
// the members, the shardrun containers and the host through the published
// ports all verify it) and one client certificate for the shardrun
// containers, etcdctl and the deploy test. `make deploy-test` runs it (via
// deploy/standins/build.sh); nothing it writes is committed.
//
//	go run ./internal/cmd/certgen -out deploy/certs
//
// It keeps the files of an earlier run (-force makes new ones). Keys are
// readable by their owner only; run as root, it gives the client key to
// the shardrun image's user (-client-uid, 65532: distroless's nonroot)
// and the members' keys to root (etcd's image runs as root). Otherwise
// every key is readable by all, which is fit only for a throwaway setup.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/shardrun/shardrun/internal/certgen"
)

func main() {
	out := flag.String("out", "deploy/certs", "directory to write ca.crt, etcd{1,2,3}.{crt,key}, client.{crt,key} into")
	members := flag.Int("members", 3, "etcd members (etcd1 … etcdN)")
	clientUID := flag.Int("client-uid", 65532, "owner of client.key when run as root")
	force := flag.Bool("force", false, "replace certificates made by an earlier run")
	flag.Parse()
	if err := run(*out, *members, *clientUID, *force); err != nil {
		fmt.Fprintln(os.Stderr, "certgen:", err)
		os.Exit(1)
	}
}

func run(out string, members, clientUID int, force bool) error {
	if _, err := os.Stat(filepath.Join(out, "ca.crt")); err == nil && !force {
		fmt.Printf("certgen: keeping the certificates in %s (-force replaces them)\n", out)
		return nil
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", out, err)
	}
	ca, err := certgen.NewCA("shardrun deploy CA")
	if err != nil {
		return err
	}
	root := os.Geteuid() == 0
	keyMode := os.FileMode(0o644)
	if root {
		keyMode = 0o600
	}
	write := func(name string, b []byte, mode os.FileMode, uid int) error {
		path := filepath.Join(out, name)
		if err := os.WriteFile(path, b, mode); err != nil {
			return fmt.Errorf("writing %s: %w", path, err)
		}
		if err := os.Chmod(path, mode); err != nil {
			return fmt.Errorf("setting the mode of %s: %w", path, err)
		}
		if root {
			if err := os.Chown(path, uid, uid); err != nil {
				return fmt.Errorf("handing %s to uid %d: %w", path, uid, err)
			}
		}
		return nil
	}
	if err := write("ca.crt", ca.PEM, 0o644, 0); err != nil {
		return err
	}
	for i := 1; i <= members; i++ {
		name := fmt.Sprintf("etcd%d", i)
		pair, err := ca.Issue(name, name, "localhost", "127.0.0.1")
		if err != nil {
			return err
		}
		if err := write(name+".crt", pair.Cert, 0o644, 0); err != nil {
			return err
		}
		if err := write(name+".key", pair.Key, keyMode, 0); err != nil {
			return err
		}
	}
	client, err := ca.Issue("shardrun")
	if err != nil {
		return err
	}
	if err := write("client.crt", client.Cert, 0o644, 0); err != nil {
		return err
	}
	if err := write("client.key", client.Key, keyMode, clientUID); err != nil {
		return err
	}
	fmt.Printf("certgen: wrote a CA, %d etcd member certificates and a client certificate to %s\n", members, out)
	return nil
}
