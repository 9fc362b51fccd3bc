package agent_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	testpb "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/internal/tunneltest"
	"github.com/ngstone/ngstone/mux"
)

// testService is a local gRPC server: it answers with its name, streams,
// fails on request and blocks until a call's deadline, or past it.
type testService struct {
	testpb.UnimplementedTestServiceServer
	name    string
	blocked chan struct{} // closed when a blocking call saw its context end
	release chan struct{} // what a call that outlives its deadline waits for
}

func (s *testService) UnaryCall(ctx context.Context, req *testpb.SimpleRequest) (*testpb.SimpleResponse, error) {
	switch string(req.GetPayload().GetBody()) {
	case "fail":
		grpc.SetTrailer(ctx, metadata.Pairs("x-why", "asked to fail"))
		return nil, status.Error(codes.FailedPrecondition, "failing as asked")
	case "block":
		<-ctx.Done()
		close(s.blocked)
		return nil, ctx.Err()
	case "outlive":
		// Never answers by itself: grpc-go's server resets the stream
		// when the deadline fires.
		<-s.release
		return nil, ctx.Err()
	}
	return &testpb.SimpleResponse{Payload: &testpb.Payload{Body: []byte(s.name + ":" + string(req.GetPayload().GetBody()))}}, nil
}

func (s *testService) StreamingOutputCall(req *testpb.StreamingOutputCallRequest, stream testpb.TestService_StreamingOutputCallServer) error {
	for i, p := range req.GetResponseParameters() {
		if us := p.GetIntervalUs(); us > 0 {
			time.Sleep(time.Duration(us) * time.Microsecond)
		}
		if err := stream.Send(&testpb.StreamingOutputCallResponse{Payload: &testpb.Payload{Body: []byte(fmt.Sprintf("%s:%d", s.name, i))}}); err != nil {
			return err
		}
	}
	return nil
}

func (s *testService) StreamingInputCall(stream testpb.TestService_StreamingInputCallServer) error {
	n := 0
	for {
		req, err := stream.Recv()
		if err == io.EOF {
			return stream.SendAndClose(&testpb.StreamingInputCallResponse{AggregatedPayloadSize: int32(n)})
		}
		if err != nil {
			return err
		}
		n += len(req.GetPayload().GetBody())
	}
}

func (s *testService) FullDuplexCall(stream testpb.TestService_FullDuplexCallServer) error {
	for {
		req, err := stream.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if err := stream.Send(&testpb.StreamingOutputCallResponse{Payload: req.GetPayload()}); err != nil {
			return err
		}
	}
}

// grpcLocal serves svc (and gRPC health) on a loopback port over h2c.
func grpcLocal(t *testing.T, svc *testService) (*grpc.Server, string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	testpb.RegisterTestServiceServer(s, svc)
	healthpb.RegisterHealthServer(s, health.NewServer())
	go s.Serve(ln)
	t.Cleanup(s.Stop)
	return s, ln.Addr().String()
}

// grpcClient dials the edge's HTTPS listener for NAME.DOMAIN, trusting
// the edge's CA.
func grpcClient(t *testing.T, e *tunneltest.Edge, name string) testpb.TestServiceClient {
	t.Helper()
	host := name + "." + tunneltest.Domain
	cc, err := grpc.NewClient("passthrough:///"+e.Addr("https").String(),
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: e.Roots, ServerName: host})),
		grpc.WithAuthority(host))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return testpb.NewTestServiceClient(cc)
}

// grpcAgent starts an agent for name speaking h2c to local, each of set
// changing its config first.
func grpcAgent(t *testing.T, e *tunneltest.Edge, local, name, instance string, set ...func(*agent.Config)) *tunneltest.Agent {
	t.Helper()
	cfg := e.AgentConfig("", local)
	cfg.Subdomain, cfg.UpstreamProtocol, cfg.InstanceID = name, agent.ProtocolHTTP2, instance
	for _, f := range set {
		f(&cfg)
	}
	a := tunneltest.StartAgent(t, cfg)
	a.WaitOnline(t)
	return a
}

func payload(s string) *testpb.Payload { return &testpb.Payload{Body: []byte(s)} }

// TestGRPCThroughTunnel: a gRPC client reaches a local gRPC server through
// the edge (HTTPS, HTTP/2) and an agent speaking h2c to it: unary calls,
// a server stream of 1,000 messages, a client stream, a bidirectional
// stream where each message is answered before the next is sent, status
// codes and trailing metadata, deadlines, health checking; the local
// server down gives UNAVAILABLE, and one that dies mid-stream an error,
// never a clean end.
func TestGRPCThroughTunnel(t *testing.T) {
	svc := &testService{name: "local", blocked: make(chan struct{})}
	srv, addr := grpcLocal(t, svc)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	grpcAgent(t, e, addr, "grpc", "")
	c := grpcClient(t, e, "grpc")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	resp, err := c.UnaryCall(ctx, &testpb.SimpleRequest{Payload: payload("hi")})
	if err != nil || string(resp.GetPayload().GetBody()) != "local:hi" {
		t.Fatalf("unary: %v %v", resp, err)
	}

	params := make([]*testpb.ResponseParameters, 1000)
	for i := range params {
		params[i] = &testpb.ResponseParameters{}
	}
	out, err := c.StreamingOutputCall(ctx, &testpb.StreamingOutputCallRequest{ResponseParameters: params})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 1000 {
		m, err := out.Recv()
		if err != nil || string(m.GetPayload().GetBody()) != fmt.Sprintf("local:%d", i) {
			t.Fatalf("server stream message %d: %v %v", i, m, err)
		}
	}
	if _, err := out.Recv(); err != io.EOF {
		t.Fatalf("server stream end: %v, want io.EOF", err)
	}

	in, err := c.StreamingInputCall(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range 100 {
		if err := in.Send(&testpb.StreamingInputCallRequest{Payload: payload(strings.Repeat("x", 100))}); err != nil {
			t.Fatal(err)
		}
	}
	if r, err := in.CloseAndRecv(); err != nil || r.GetAggregatedPayloadSize() != 10000 {
		t.Fatalf("client stream: %v %v", r, err)
	}

	duplex, err := c.FullDuplexCall(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		// The next message goes only once this one's answer is back:
		// each must cross both ways at once, not wait in a buffer.
		msg := fmt.Sprintf("ping %d", i)
		if err := duplex.Send(&testpb.StreamingOutputCallRequest{Payload: payload(msg)}); err != nil {
			t.Fatal(err)
		}
		got, err := duplex.Recv()
		if err != nil || string(got.GetPayload().GetBody()) != msg {
			t.Fatalf("duplex %d: %v %v", i, got, err)
		}
	}
	duplex.CloseSend()
	if _, err := duplex.Recv(); err != io.EOF {
		t.Fatalf("duplex end: %v", err)
	}

	var trailer metadata.MD
	_, err = c.UnaryCall(ctx, &testpb.SimpleRequest{Payload: payload("fail")}, grpc.Trailer(&trailer))
	if status.Code(err) != codes.FailedPrecondition || status.Convert(err).Message() != "failing as asked" || trailer.Get("x-why")[0] != "asked to fail" {
		t.Fatalf("status and trailer: %v %v", err, trailer)
	}

	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = c.UnaryCall(short, &testpb.SimpleRequest{Payload: payload("block")})
	cancelShort()
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("deadline: %v", err)
	}
	select {
	case <-svc.blocked:
	case <-time.After(10 * time.Second):
		t.Fatal("the local server's call did not end with the client's deadline")
	}

	cc, err := grpc.NewClient("passthrough:///"+e.Addr("https").String(),
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: e.Roots, ServerName: "grpc." + tunneltest.Domain})),
		grpc.WithAuthority("grpc."+tunneltest.Domain))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	hr, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || hr.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health: %v %v", hr, err)
	}

	// The local server dies in the middle of a stream.
	slow := make([]*testpb.ResponseParameters, 100)
	for i := range slow {
		slow[i] = &testpb.ResponseParameters{IntervalUs: 20000}
	}
	out, err = c.StreamingOutputCall(ctx, &testpb.StreamingOutputCallRequest{ResponseParameters: slow})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := out.Recv(); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	for {
		_, err := out.Recv()
		if err == io.EOF {
			t.Fatal("a stream the local server broke off ended cleanly")
		}
		if err != nil {
			t.Logf("stream broken off: %v", err)
			break
		}
	}
	_, err = c.UnaryCall(ctx, &testpb.SimpleRequest{Payload: payload("hi")})
	if status.Code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), "upstream_unreachable") {
		t.Fatalf("local server down: %v, want UNAVAILABLE with the agent's reason", err)
	}
	t.Logf("local server down: %v", err)
}

// TestGRPCTakeover: a same-instance takeover during a long server stream:
// the stream finishes on the old session, new calls go to the new one.
func TestGRPCTakeover(t *testing.T) {
	_, oldAddr := grpcLocal(t, &testService{name: "old"})
	_, newAddr := grpcLocal(t, &testService{name: "new"})
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	id := agent.NewInstanceID()
	grpcAgent(t, e, oldAddr, "move", id)
	c := grpcClient(t, e, "move")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	params := make([]*testpb.ResponseParameters, 50)
	for i := range params {
		params[i] = &testpb.ResponseParameters{IntervalUs: 20000}
	}
	out, err := c.StreamingOutputCall(ctx, &testpb.StreamingOutputCallRequest{ResponseParameters: params})
	if err != nil {
		t.Fatal(err)
	}
	if m, err := out.Recv(); err != nil || string(m.GetPayload().GetBody()) != "old:0" {
		t.Fatalf("first message: %v %v", m, err)
	}
	grpcAgent(t, e, newAddr, "move", id) // takes the name over
	resp, err := c.UnaryCall(ctx, &testpb.SimpleRequest{Payload: payload("after")})
	if err != nil || string(resp.GetPayload().GetBody()) != "new:after" {
		t.Fatalf("a call after the takeover: %v %v, want the new agent's", resp, err)
	}
	for i := 1; i < 50; i++ {
		m, err := out.Recv()
		if err != nil || string(m.GetPayload().GetBody()) != fmt.Sprintf("old:%d", i) {
			t.Fatalf("message %d of the stream in flight: %v %v", i, m, err)
		}
	}
	if _, err := out.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("end of the stream in flight: %v", err)
	}
}

// TestGRPCInInspector: the inspector keeps a gRPC call with its method
// path and grpc-status, its bodies as they came.
func TestGRPCInInspector(t *testing.T) {
	_, addr := grpcLocal(t, &testService{name: "local"})
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	a := grpcAgent(t, e, addr, "seen", "", inspected)
	c := grpcClient(t, e, "seen")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c.UnaryCall(ctx, &testpb.SimpleRequest{Payload: payload("fail")})
	got := keptExchange(t, a)
	if got.Path != "/grpc.testing.TestService/UnaryCall" || got.GRPCStatus != fmt.Sprint(int(codes.FailedPrecondition)) || got.Request.Size == 0 {
		t.Fatalf("kept: %+v", got)
	}
}

// inspected gives an agent its inspector.
func inspected(cfg *agent.Config) { cfg.InspectAddr = "127.0.0.1:0" }

// keptExchange waits for a's inspector to keep one exchange, and returns
// it.
func keptExchange(t *testing.T, a *tunneltest.Agent) agent.Capture {
	t.Helper()
	var got []agent.Capture
	tunneltest.Eventually(t, 5*time.Second, "the call kept", func() bool {
		got = a.Inspector().List()
		return len(got) > 0
	})
	if len(got) != 1 {
		t.Fatalf("kept %d exchanges, want the one call: %+v", len(got), got)
	}
	return got[0]
}

// TestGRPCAgentAnswerInInspector: a call the agent answers itself (its
// local server down, a password it asks for) reaches the client as a
// grpc-status, and the inspector's row shows the status the client got,
// beside the agent's code.
func TestGRPCAgentAnswerInInspector(t *testing.T) {
	_, up := grpcLocal(t, &testService{name: "local"})
	gone, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone.Close() // nothing listens there now
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	for _, tc := range []struct {
		name, local string
		set         func(*agent.Config)
		want        codes.Code
		code        string
	}{
		{"down", gone.Addr().String(), inspected, codes.Unavailable, mux.CodeUpstreamUnreachable},
		{"locked", up, func(cfg *agent.Config) {
			inspected(cfg)
			cfg.BasicAuth = []string{"alice:correct horse"}
		}, codes.Unauthenticated, mux.CodeBasicAuthRequired},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := grpcAgent(t, e, tc.local, tc.name, "", tc.set)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := grpcClient(t, e, tc.name).UnaryCall(ctx, &testpb.SimpleRequest{Payload: payload("hi")})
			if status.Code(err) != tc.want {
				t.Fatalf("the client got %v, want %v", err, tc.want)
			}
			got := keptExchange(t, a)
			if got.GRPCStatus != fmt.Sprint(int(status.Code(err))) || got.Code != tc.code {
				t.Fatalf("kept grpc-status %q, code %q; the client got %d (%v), the agent answered %s",
					got.GRPCStatus, got.Code, status.Code(err), err, tc.code)
			}
		})
	}
}

// TestGRPCServerDeadline: the local server ends a call at the deadline its
// client set (grpc-go resets the stream, CANCEL, as the deadline fires). A
// client whose own timer has not fired yet (late on a loaded machine, or
// one that sends grpc-timeout without a timer) reads DEADLINE_EXCEEDED, as
// it would from the server directly, not the UNAVAILABLE of a broken
// response. A local server that cannot be reached keeps its code, however
// late: the deadline did not end that call.
func TestGRPCServerDeadline(t *testing.T) {
	svc := &testService{name: "local", release: make(chan struct{})}
	_, addr := grpcLocal(t, svc)
	defer close(svc.release)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	served := grpcAgent(t, e, addr, "grpc", "", inspected)
	gone, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone.Close() // nothing listens there now
	down := grpcAgent(t, e, gone.Addr().String(), "gone", "", inspected)
	tr := &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: e.Roots},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, e.Addr("https").String())
		},
		Protocols: new(http.Protocols),
	}
	tr.Protocols.SetHTTP2(true)
	defer tr.CloseIdleConnections()
	// call sends a unary call to name with grpc-timeout and no timer of
	// its own, and returns its grpc-status and Ngstone-Error.
	call := func(name, timeout string) (status, code string) {
		msg, err := proto.Marshal(&testpb.SimpleRequest{Payload: payload("outlive")})
		if err != nil {
			t.Fatal(err)
		}
		body := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(msg))) // uncompressed, its length
		req, err := http.NewRequest("POST", "https://"+name+"."+tunneltest.Domain+"/grpc.testing.TestService/UnaryCall",
			bytes.NewReader(append(body, msg...)))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/grpc")
		req.Header.Set("Te", "trailers")
		req.Header.Set("Grpc-Timeout", timeout)
		resp, err := (&http.Client{Transport: tr, Timeout: 20 * time.Second}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.Header.Get("Grpc-Status") + resp.Trailer.Get("Grpc-Status"), resp.Header.Get(mux.ErrorHeader)
	}
	status, code := call("grpc", "200m")
	if status != "4" || code != "" {
		t.Errorf("a call the local server ended at its deadline: grpc-status %q, %s %q; want 4 DEADLINE_EXCEEDED from the server", status, mux.ErrorHeader, code)
	}
	if kept := keptExchange(t, served); kept.GRPCStatus != status {
		t.Errorf("the inspector shows grpc-status %q, the client got %q", kept.GRPCStatus, status)
	}
	status, code = call("gone", "1n")
	if status != "14" || code != mux.CodeUpstreamUnreachable {
		t.Errorf("a call past its deadline to a local server that is down: grpc-status %q, %s %q; want 14 and %s", status, mux.ErrorHeader, code, mux.CodeUpstreamUnreachable)
	}
	if kept := keptExchange(t, down); kept.GRPCStatus != status {
		t.Errorf("the inspector shows grpc-status %q, the client got %q", kept.GRPCStatus, status)
	}
}

// TestTrailersOnlyWhileUploading: a gRPC answer that is its head alone
// (Trailers-Only: a status, no message) reaches the visitor as one, with a
// length of 0, even when the local server answers before the request's
// body has ended, and the agent sends the answer at once to read the rest
// of the body: sent chunked, it would reach an HTTP/2 visitor as a head
// and a separate end, which a gRPC client refuses as a stream that ended
// without its status.
func TestTrailersOnlyWhileUploading(t *testing.T) {
	svc := &testService{name: "local", blocked: make(chan struct{})}
	_, addr := grpcLocal(t, svc)
	e := tunneltest.StartEdge(t, tunneltest.EdgeConfig(t))
	grpcAgent(t, e, addr, "grpc", "")
	msg, err := proto.Marshal(&testpb.SimpleRequest{Payload: payload("fail")})
	if err != nil {
		t.Fatal(err)
	}
	frame := make([]byte, 5+len(msg))
	binary.BigEndian.PutUint32(frame[1:], uint32(len(msg)))
	copy(frame[5:], msg)
	pr, pw := io.Pipe()
	defer pw.Close()
	go pw.Write(frame) // the message, and the body's end only once the answer is in
	req, _ := http.NewRequest("POST", tunneltest.URL("https", "grpc", "/grpc.testing.TestService/UnaryCall"), pr)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("Te", "trailers")
	resp, err := e.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.ProtoMajor != 2 || resp.ContentLength != 0 || resp.Header.Get("Grpc-Status") != strconv.Itoa(int(codes.FailedPrecondition)) {
		t.Fatalf("%s %d, length %d, grpc-status %q: want a Trailers-Only answer", resp.Proto, resp.StatusCode, resp.ContentLength, resp.Header.Get("Grpc-Status"))
	}
}
