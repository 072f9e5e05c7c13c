// Command etcd is a thin wrapper around etcd's own server main, so that the
// test cluster can build etcd from the published Go modules (etcd's module
// carries local replace directives, so `go install` of it is refused).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
