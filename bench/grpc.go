package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// grpcSub is the subdomain of the gRPC phase's tunnel.
const grpcSub = "grpc-bench"

// grpcUnary measures unary gRPC calls (grpc.health.v1 Check, a few bytes
// each way) from one client connection, as gRPC clients multiplex their
// calls: through a tunnel whose agent speaks h2c to a local gRPC server
// (--upstream-protocol http2), visited over HTTPS (gRPC needs HTTP/2 at
// the edge), against the same server reached directly.
func (b *bench) grpcUnary() error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go srv.Serve(ln)
	defer srv.Stop()

	agent, err := b.startGRPCAgent(ln.Addr().String())
	if err != nil {
		return err
	}
	defer agent.stop()

	direct, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer direct.Close()
	tunnel, err := b.grpcTunnelClient()
	if err != nil {
		return err
	}
	defer tunnel.Close()

	for _, c := range b.o.concs {
		d := grpcCalls(direct, c, b.o.dur)
		e0, a0 := b.edge.cpu(), agent.cpu()
		t := grpcCalls(tunnel, c, b.o.dur)
		e1, a1 := b.edge.cpu(), agent.cpu()
		if t.n == 0 || d.n == 0 {
			return fmt.Errorf("gRPC c=%d: no successful call (tunnel errors %d, direct errors %d)", c, t.errs, d.errs)
		}
		rate, p50 := loadRows(fmt.Sprintf("gRPC unary c=%d", c), d, t)
		rate.name = fmt.Sprintf("gRPC unary c=%d calls/s", c)
		b.add(rate)
		b.add(p50)
		if c == 16 {
			b.add(row{name: "edge CPU per 10k gRPC calls (c=16)", tunnel: per10k(e1-e0, t.n)})
			b.add(row{name: "agent CPU per 10k gRPC calls (c=16)", tunnel: per10k(a1-a0, t.n)})
		}
	}
	return nil
}

// startGRPCAgent starts an agent for the gRPC server at local, speaking
// h2c to it, and waits until a health check through the tunnel answers.
func (b *bench) startGRPCAgent(local string) (*proc, error) {
	ca := filepath.Join(b.dir, "edge", "ca.pem")
	var args, env []string
	if b.o.self {
		env = []string{roleEnv + "=agent"}
		args = []string{"-edge", b.addrs["control"], "-ca-file", ca, "-local", local, "-subdomain", grpcSub,
			"-upstream-protocol", "http2", "-window", strconv.FormatUint(uint64(b.o.window), 10)}
	} else {
		args = []string{"http", local, "--edge", b.addrs["control"], "--ca-file", ca, "--subdomain", grpcSub,
			"--upstream-protocol", "http2", "--inspect=false", "--log-format", "json"}
	}
	p, err := startProc("agent "+grpcSub, b.bin, args, append(env, b.o.childEnv...), filepath.Join(b.dir, "agent-"+grpcSub+".log"))
	if err != nil {
		return nil, err
	}
	c, err := b.grpcTunnelClient()
	if err != nil {
		p.kill()
		return nil, err
	}
	defer c.Close()
	hc := healthpb.NewHealthClient(c)
	deadline := time.Now().Add(15 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil {
			return p, nil
		}
		if time.Now().After(deadline) {
			p.kill()
			return nil, fmt.Errorf("agent %s: no health check answered through the tunnel within 15s: %w", grpcSub, err)
		}
		select {
		case <-p.done:
			return nil, errors.New("the gRPC agent exited; see its log with -keep")
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// grpcTunnelClient is a client of the gRPC tunnel, dialing the edge's
// HTTPS listener and trusting its CA.
func (b *bench) grpcTunnelClient() (*grpc.ClientConn, error) {
	host := grpcSub + "." + domain
	creds := credentials.NewTLS(&tls.Config{ServerName: host, RootCAs: b.ca})
	return grpc.NewClient(b.addrs["https"], grpc.WithTransportCredentials(creds), grpc.WithAuthority(host))
}

// grpcCalls runs conc callers of Check on c for d, after a warm-up.
func grpcCalls(c *grpc.ClientConn, conc int, d time.Duration) loadResult {
	grpcRun(c, conc, d/5)
	return grpcRun(c, conc, d)
}

func grpcRun(c *grpc.ClientConn, conc int, d time.Duration) loadResult {
	hc := healthpb.NewHealthClient(c)
	return measure(conc, d, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		return err == nil
	})
}
