// Embedded etcd: the control plane's storage, run in-process at the version Kubernetes pins.
package main

import (
	"fmt"
	"net/url"
	"path/filepath"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// startEtcd starts a single-member etcd with its data under dir and returns it once it serves.
func startEtcd(dir string, clientPort, peerPort int, logFile string) (*embed.Etcd, error) {
	cfg := embed.NewConfig()
	cfg.Name = "poolpilot"
	cfg.Dir = filepath.Join(dir, "etcd")
	client := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", clientPort)}
	peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	// A test cluster: durability across power loss is not worth the fsync latency.
	cfg.UnsafeNoFsync = true
	cfg.LogLevel = "warn"
	cfg.LogOutputs = []string{logFile}
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(nil)
	lcfg := zap.NewProductionConfig()
	lcfg.Level = zap.NewAtomicLevelAt(zap.WarnLevel)
	lcfg.OutputPaths = []string{logFile}
	lcfg.ErrorOutputPaths = []string{logFile}
	logger, err := lcfg.Build()
	if err != nil {
		return nil, fmt.Errorf("etcd logger: %w", err)
	}
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(logger)

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, fmt.Errorf("start etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, nil
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("etcd failed while starting: %w", err)
	case <-time.After(60 * time.Second):
		e.Server.Stop()
		e.Close()
		return nil, fmt.Errorf("etcd not ready after 60s")
	}
}
