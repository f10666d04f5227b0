package deploy

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/shardrun/shardrun/internal/testutil"
)

// TestComposeFileIsValid checks docker-compose.yml with `docker-compose
// config` (Debian's docker-compose; .ci/run installs it): it parses, names
// every service, runs three etcd members, two coordinators and three
// runners, has the emails pool under the profile pools and a second
// PostgreSQL under the profile databases, and refuses to start without tokens. It needs no Docker engine;
// the deploy test (build tag deploy) runs the file.
func TestComposeFileIsValid(t *testing.T) {
	bin, err := exec.LookPath("docker-compose")
	if err != nil {
		testutil.MissingTool(t, "docker-compose is not installed (apt-get install docker-compose) to check docker-compose.yml")
	}
	cmd := exec.Command(bin, "-f", "../docker-compose.yml", "config")
	cmd.Env = append(os.Environ(), "SHARDRUN_ADMIN_TOKEN=t1", "SHARDRUN_API_TOKEN=t2")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("docker-compose config: %v\n%s", err, out)
	}
	config := string(out)
	for _, want := range []string{"  etcd1:", "  etcd2:", "  etcd3:", "  postgres:", "  coordinator1:", "  coordinator2:", "  runner:",
		"replicas: 3", "SHARDRUN_ADMIN_TOKEN: t1", "SHARDRUN_API_TOKEN: t2", "healthcheck:", "etcd1-data:", "pg-data:",
		"condition: service_healthy", "SHARDRUN_ETCD_ENDPOINTS: https://etcd1:2379,https://etcd2:2379,https://etcd3:2379", "SHARDRUN_ETCD_KEY_FILE: /certs/client.key", "ETCD_CLIENT_CERT_AUTH: \"true\"", "ETCD_PEER_CLIENT_CERT_AUTH: \"true\"",
		"ETCD_INITIAL_CLUSTER: etcd1=https://etcd1:2380,etcd2=https://etcd2:2380,etcd3=https://etcd3:2380"} {
		if !strings.Contains(config, want) {
			t.Errorf("compose config lacks %q", want)
		}
	}
	// The emails pool, under its profile.
	cmd = exec.Command(bin, "-f", "../docker-compose.yml", "--profile", "pools", "config")
	cmd.Env = append(os.Environ(), "SHARDRUN_ADMIN_TOKEN=t1", "SHARDRUN_API_TOKEN=t2")
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "  runner-emails:") || !strings.Contains(string(out), "- emails=8") {
		t.Errorf("docker-compose --profile pools config: want the runner-emails pool serving emails=8: %v\n%s", err, out)
	}
	// A second database, under its profile, named to every process by
	// SHARDRUN_DATABASES.
	cmd = exec.Command(bin, "-f", "../docker-compose.yml", "--profile", "databases", "config")
	cmd.Env = append(os.Environ(), "SHARDRUN_ADMIN_TOKEN=t1", "SHARDRUN_API_TOKEN=t2", "SHARDRUN_DATABASES=second=postgres://shardrun@postgres2:5432/shardrun")
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "  postgres2:") || !strings.Contains(string(out), "SHARDRUN_DATABASES: second=postgres://shardrun@postgres2:5432/shardrun") {
		t.Errorf("docker-compose --profile databases config: want postgres2 and SHARDRUN_DATABASES passed on: %v\n%s", err, out)
	}
	cmd = exec.Command(bin, "-f", "../docker-compose.yml", "config")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "SHARDRUN_") {
		t.Errorf("the compose file must refuse to start without admin and API tokens: %v\n%s", err, out)
	}
}
