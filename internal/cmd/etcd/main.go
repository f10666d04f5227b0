// Command etcd is etcd's own server (etcdmain), built from the module
// version in go.mod, so that the fault tests run a multi-member cluster of
// separate processes whose leader can be killed with SIGKILL.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
