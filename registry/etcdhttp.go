package registry

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// etcdClient speaks etcd's v3 JSON API (the gRPC gateway every etcd v3.5+
// member serves on its client URLs) over net/http. The official client
// links gRPC, protobuf and etcd's API packages, which cost every ngstone
// process, agents included, about 5 MiB of resident memory and 9 MB of
// binary whether or not it ever joins a cluster. The calls here are the few
// the registry needs: range, put, delete, txn, lease grant, revoke and
// keep-alive, and watch.
type etcdClient struct {
	endpoints []string
	hc        *http.Client // for unary calls, bounded
	stream    *http.Client // for watches, unbounded
	user      string
	password  string

	mu    sync.Mutex
	next  int    // the endpoint to try first
	token string // auth token, when user is set
}

// etcdError is an error answered by etcd.
type etcdError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func (e *etcdError) Error() string { return "etcd: " + e.Message }

// errLeaseNotFound is etcd's answer for an expired or revoked lease.
var errLeaseNotFound = errors.New("etcd: lease not found")

func newEtcdClient(endpoints []string, tc *tls.Config, user, password string) *etcdClient {
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 15 * time.Second}).DialContext,
		TLSClientConfig:     tc,
		TLSHandshakeTimeout: 5 * time.Second,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
	}
	return &etcdClient{
		endpoints: endpoints, user: user, password: password,
		hc:     &http.Client{Transport: tr, Timeout: 15 * time.Second},
		stream: &http.Client{Transport: tr},
	}
}

func (c *etcdClient) close() { c.hc.CloseIdleConnections() }

// call POSTs req to path and decodes the answer into resp, trying each
// endpoint in turn while they cannot be reached. An expired auth token is
// replaced once.
func (c *etcdClient) call(ctx context.Context, path string, req, resp any) error {
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	err = c.callOnce(ctx, path, body, resp)
	var ee *etcdError
	if c.user != "" && errors.As(err, &ee) && strings.Contains(ee.Message, "invalid auth token") {
		c.mu.Lock()
		c.token = ""
		c.mu.Unlock()
		err = c.callOnce(ctx, path, body, resp)
	}
	return err
}

func (c *etcdClient) callOnce(ctx context.Context, path string, body []byte, resp any) error {
	var last error
	for range len(c.endpoints) {
		ep := c.endpoint()
		r, err := c.post(ctx, c.hc, ep, path, body)
		if err != nil {
			if ctx.Err() != nil {
				return err
			}
			last = err
			c.failed(ep)
			continue
		}
		defer r.Body.Close()
		b, err := io.ReadAll(io.LimitReader(r.Body, 64<<20))
		if err != nil {
			return fmt.Errorf("etcd %s: %w", path, err)
		}
		if r.StatusCode != http.StatusOK {
			return decodeEtcdError(b, r.StatusCode)
		}
		if err := json.Unmarshal(b, resp); err != nil {
			return fmt.Errorf("etcd %s: %w", path, err)
		}
		return nil
	}
	return fmt.Errorf("etcd %s: no endpoint answered: %w", path, last)
}

func (c *etcdClient) post(ctx context.Context, hc *http.Client, ep, path string, body []byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ep+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if c.user != "" && path != "/v3/auth/authenticate" {
		tok, err := c.authToken(ctx, ep)
		if err != nil {
			return nil, err
		}
		req.Header.Set("Authorization", tok)
	}
	return hc.Do(req)
}

// authToken returns the auth token, asking ep for one the first time.
func (c *etcdClient) authToken(ctx context.Context, ep string) (string, error) {
	c.mu.Lock()
	tok := c.token
	c.mu.Unlock()
	if tok != "" {
		return tok, nil
	}
	body, _ := json.Marshal(map[string]string{"name": c.user, "password": c.password})
	r, err := c.post(ctx, c.hc, ep, "/v3/auth/authenticate", body)
	if err != nil {
		return "", err
	}
	defer r.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if r.StatusCode != http.StatusOK {
		return "", decodeEtcdError(b, r.StatusCode)
	}
	var resp struct {
		Token string `json:"token"`
	}
	if err := json.Unmarshal(b, &resp); err != nil || resp.Token == "" {
		return "", fmt.Errorf("etcd: authenticate: no token in the answer")
	}
	c.mu.Lock()
	c.token = resp.Token
	c.mu.Unlock()
	return resp.Token, nil
}

func decodeEtcdError(b []byte, status int) error {
	var e etcdError
	if json.Unmarshal(b, &e) != nil || e.Message == "" {
		e.Message = fmt.Sprintf("HTTP %d: %.200s", status, b)
	}
	if strings.Contains(e.Message, "requested lease not found") {
		return errLeaseNotFound
	}
	return &e
}

func (c *etcdClient) endpoint() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.endpoints[c.next%len(c.endpoints)]
}

// failed moves on from ep.
func (c *etcdClient) failed(ep string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.endpoints[c.next%len(c.endpoints)] == ep {
		c.next++
	}
}

// The JSON shapes of etcd's API: bytes are base64, 64-bit numbers strings,
// and fields at their zero value are left out.

type etcdHeader struct {
	Revision int64 `json:"revision,string"`
}

type etcdKV struct {
	Key            []byte `json:"key"`
	Value          []byte `json:"value,omitempty"`
	CreateRevision int64  `json:"create_revision,string,omitempty"`
	ModRevision    int64  `json:"mod_revision,string,omitempty"`
	Lease          int64  `json:"lease,string,omitempty"`
}

type etcdRangeReq struct {
	Key        []byte `json:"key"`
	RangeEnd   []byte `json:"range_end,omitempty"`
	SortOrder  string `json:"sort_order,omitempty"`
	SortTarget string `json:"sort_target,omitempty"`
	KeysOnly   bool   `json:"keys_only,omitempty"`
}

type etcdRangeResp struct {
	Header etcdHeader `json:"header"`
	Kvs    []etcdKV   `json:"kvs"`
}

type etcdPutReq struct {
	Key   []byte `json:"key"`
	Value []byte `json:"value"`
	Lease int64  `json:"lease,string,omitempty"`
}

type etcdDeleteReq struct {
	Key []byte `json:"key"`
}

// etcdCmp is one compare of a transaction: the key's target ("MOD" or
// "CREATE") revision equal to the value (left out when zero, which etcd
// reads as zero).
type etcdCmp struct {
	Key            []byte `json:"key"`
	Target         string `json:"target"`
	Result         string `json:"result"`
	ModRevision    int64  `json:"mod_revision,string,omitempty"`
	CreateRevision int64  `json:"create_revision,string,omitempty"`
}

type etcdOp struct {
	Put    *etcdPutReq    `json:"request_put,omitempty"`
	Delete *etcdDeleteReq `json:"request_delete_range,omitempty"`
	Range  *etcdRangeReq  `json:"request_range,omitempty"`
}

type etcdTxnReq struct {
	Compare []etcdCmp `json:"compare"`
	Success []etcdOp  `json:"success,omitempty"`
	Failure []etcdOp  `json:"failure,omitempty"`
}

type etcdTxnResp struct {
	Header    etcdHeader `json:"header"`
	Succeeded bool       `json:"succeeded"`
	Responses []struct {
		Range *etcdRangeResp `json:"response_range"`
	} `json:"responses"`
}

func modIs(key string, rev int64) etcdCmp {
	return etcdCmp{Key: []byte(key), Target: "MOD", Result: "EQUAL", ModRevision: rev}
}

func absent(key string) etcdCmp {
	return etcdCmp{Key: []byte(key), Target: "CREATE", Result: "EQUAL"}
}

// prefixEnd is the range end that makes key a prefix.
func prefixEnd(key string) []byte {
	end := []byte(key)
	for i := len(end) - 1; i >= 0; i-- {
		if end[i] < 0xff {
			end[i]++
			return end[:i+1]
		}
	}
	return []byte{0}
}

func (c *etcdClient) get(ctx context.Context, key string, prefix bool) (*etcdRangeResp, error) {
	req := etcdRangeReq{Key: []byte(key)}
	if prefix {
		req.RangeEnd, req.SortOrder, req.SortTarget = prefixEnd(key), "ASCEND", "KEY"
	}
	var resp etcdRangeResp
	return &resp, c.call(ctx, "/v3/kv/range", req, &resp)
}

func (c *etcdClient) put(ctx context.Context, key, val string, lease int64) error {
	var resp struct{}
	return c.call(ctx, "/v3/kv/put", etcdPutReq{Key: []byte(key), Value: []byte(val), Lease: lease}, &resp)
}

func (c *etcdClient) delete(ctx context.Context, key string) error {
	var resp struct{}
	return c.call(ctx, "/v3/kv/deleterange", etcdDeleteReq{Key: []byte(key)}, &resp)
}

func (c *etcdClient) txn(ctx context.Context, req etcdTxnReq) (*etcdTxnResp, error) {
	var resp etcdTxnResp
	return &resp, c.call(ctx, "/v3/kv/txn", req, &resp)
}

func (c *etcdClient) grant(ctx context.Context, ttl int64) (int64, error) {
	var resp struct {
		ID    int64  `json:"ID,string"`
		Error string `json:"error"`
	}
	if err := c.call(ctx, "/v3/lease/grant", map[string]string{"TTL": fmt.Sprint(ttl)}, &resp); err != nil {
		return 0, err
	}
	if resp.ID == 0 {
		return 0, fmt.Errorf("etcd: lease grant: %s", resp.Error)
	}
	return resp.ID, nil
}

func (c *etcdClient) revoke(ctx context.Context, id int64) error {
	var resp struct{}
	return c.call(ctx, "/v3/lease/revoke", map[string]string{"ID": fmt.Sprint(id)}, &resp)
}

// keepAliveOnce renews lease id once; errLeaseNotFound when it expired.
func (c *etcdClient) keepAliveOnce(ctx context.Context, id int64) error {
	var resp struct {
		Result struct {
			TTL int64 `json:"TTL,string"`
		} `json:"result"`
	}
	if err := c.call(ctx, "/v3/lease/keepalive", map[string]string{"ID": fmt.Sprint(id)}, &resp); err != nil {
		return err
	}
	if resp.Result.TTL <= 0 {
		return errLeaseNotFound
	}
	return nil
}

// etcdEvent is one change a watch reports.
type etcdEvent struct {
	Type   string  `json:"type"` // "" for a put, "DELETE"
	Kv     etcdKV  `json:"kv"`
	PrevKv *etcdKV `json:"prev_kv"`
}

type etcdWatchResp struct {
	Result struct {
		Header          etcdHeader  `json:"header"`
		Created         bool        `json:"created"`
		Canceled        bool        `json:"canceled"`
		CompactRevision int64       `json:"compact_revision,string"`
		CancelReason    string      `json:"cancel_reason"`
		Events          []etcdEvent `json:"events"`
	} `json:"result"`
	Error *etcdError `json:"error"`
}

// watch streams the changes under prefix from revision from, with each
// change's previous value, calling fn for each answer until ctx ends or the
// stream breaks; it returns why it broke.
func (c *etcdClient) watch(ctx context.Context, prefix string, from int64, fn func(*etcdWatchResp)) error {
	body, _ := json.Marshal(map[string]any{"create_request": map[string]any{
		"key": []byte(prefix), "range_end": prefixEnd(prefix), "start_revision": fmt.Sprint(from), "prev_kv": true,
	}})
	ep := c.endpoint()
	r, err := c.post(ctx, c.stream, ep, "/v3/watch", body)
	if err != nil {
		c.failed(ep)
		return err
	}
	defer r.Body.Close()
	if r.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		return decodeEtcdError(b, r.StatusCode)
	}
	dec := json.NewDecoder(bufio.NewReaderSize(r.Body, 64<<10))
	for {
		var wr etcdWatchResp
		if err := dec.Decode(&wr); err != nil {
			return fmt.Errorf("etcd watch: %w", err)
		}
		switch res := &wr.Result; {
		case wr.Error != nil:
			return wr.Error
		case res.CompactRevision != 0:
			return fmt.Errorf("etcd watch: revision %d compacted (now %d)", from, res.CompactRevision)
		case res.Canceled:
			return fmt.Errorf("etcd watch canceled: %s", res.CancelReason)
		}
		fn(&wr)
	}
}
