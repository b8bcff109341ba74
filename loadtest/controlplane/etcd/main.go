// Command etcd is the etcd server, built from the official module so that the
// test bed needs nothing beyond the Go module proxy.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
