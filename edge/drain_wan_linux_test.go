package edge

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ngstone/ngstone/internal/wan"
	"github.com/ngstone/ngstone/internal/wan/wantest"
)

// TestDrainTakesHandshakesUnderWay: a visitor 400 ms away whose SYN has
// reached the edge when a graceful stop begins has its SYN-ACK on the way:
// it will be connected in its own eyes and send its request. The drain
// must let that handshake complete and serve it; a filter that dropped
// its last ACK would leave the visitor reset after its request.
func TestDrainTakesHandshakesUnderWay(t *testing.T) {
	p := wantest.Start(t)
	p.Set(wan.Symmetric("drain", 400*time.Millisecond, 0, 0))
	var ln net.Listener
	if err := p.B.Do(func() (err error) {
		ln, err = listenVisitors("tcp", netip.AddrPortFrom(p.AddrB(), 0).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	q := &drainingListener{Listener: ln}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer ln.Close()
	wg.Go(func() {
		for {
			c, err := q.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(10 * time.Second))
				if _, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
					io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
				}
			})
		}
	})
	got := make(chan string, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := p.A.DialContext(ctx, "tcp", ln.Addr().String())
		if err != nil {
			got <- "dial: " + err.Error()
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: drain.test\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			got <- "after the request: " + err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		got <- fmt.Sprint(resp.StatusCode, " ", string(b))
	}()
	port := fmt.Sprintf(":%04X ", ln.Addr().(*net.TCPAddr).Port)
	deadline := time.Now().Add(5 * time.Second)
	for !synReceived(t, p.B, port) {
		if time.Now().After(deadline) {
			t.Fatal("the visitor's SYN never reached the listener")
		}
		time.Sleep(2 * time.Millisecond) // polling the kernel's table
	}
	if !q.drain(context.Background(), 2*time.Second) {
		t.Fatal("the listener refused the filter")
	}
	ln.Close()
	if r := <-got; r != "200 ok" {
		t.Fatalf("the visitor whose handshake was under way got %q, want 200 ok", r)
	}
}

// synReceived reports whether ns's kernel holds a handshake in SYN_RECV
// (state 03 of /proc/net/tcp) on the local port given as ":PORT ".
func synReceived(t *testing.T, ns *wan.NS, port string) bool {
	var table []byte
	if err := ns.Do(func() (err error) {
		table, err = os.ReadFile("/proc/thread-self/net/tcp")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(table), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) > 3 && strings.HasSuffix(f[1], strings.TrimSpace(port)) && f[3] == "03" {
			return true
		}
	}
	return false
}
