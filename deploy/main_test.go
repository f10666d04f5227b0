// Package deploy holds the tests of the deployment files: the compose
// file's configuration (always), and behind the build tag deploy the whole
// deployment on a Docker engine (`make deploy-test`).
package deploy

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/shardrun/shardrun/internal/testutil"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testutil.EtcdLeaks...)
}
