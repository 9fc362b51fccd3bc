package certs

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/caddyserver/certmagic"
	"github.com/libdns/libdns"
)

// cloudflareAPI is the Cloudflare API v4 base URL.
const cloudflareAPI = "https://api.cloudflare.com/client/v4"

// cloudflare sets and removes DNS-01 records through the Cloudflare API v4,
// with the tokens' meaning of libdns/cloudflare (and Caddy's docs):
// apiToken edits the records (Zone.DNS:Edit, may be scoped to the one
// zone); zoneToken, if given, finds the zone's id (Zone.Zone:Read, may
// span all zones). Without zoneToken, apiToken needs both permissions.
type cloudflare struct {
	apiToken, zoneToken string
	ownZoneToken        bool // zone_token was given
	base                string
	client              *http.Client
}

func (p *cloudflare) zoneTokenName() string {
	if p.ownZoneToken {
		return "zone_token"
	}
	return "api_token (no zone_token set)"
}

func newCloudflare(vals map[string]string) (certmagic.DNSProvider, error) {
	p := &cloudflare{apiToken: vals["api_token"], zoneToken: vals["zone_token"], base: vals["base_url"]}
	p.ownZoneToken = p.zoneToken != ""
	if p.zoneToken == "" {
		p.zoneToken = p.apiToken
	}
	if p.base == "" {
		p.base = cloudflareAPI
	}
	if _, err := url.Parse(p.base); err != nil {
		return nil, fmt.Errorf("setting base_url: %w", err)
	}
	p.base = strings.TrimSuffix(p.base, "/")
	p.client = &http.Client{Timeout: 30 * time.Second}
	return p, nil
}

type cfRecord struct {
	ID      string `json:"id,omitempty"`
	Type    string `json:"type"`
	Name    string `json:"name"`
	Content string `json:"content"`
	TTL     int    `json:"ttl"`
}

type cfResponse struct {
	Success bool            `json:"success"`
	Errors  []cfError       `json:"errors"`
	Result  json.RawMessage `json:"result"`
}

type cfError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// AppendRecords creates recs in zone.
func (p *cloudflare) AppendRecords(ctx context.Context, zone string, recs []libdns.Record) ([]libdns.Record, error) {
	id, err := p.zoneID(ctx, zone)
	if err != nil {
		return nil, err
	}
	for _, r := range recs {
		rec := p.toRecord(r.RR(), zone)
		if err := p.do(ctx, p.apiToken, http.MethodPost, "/zones/"+id+"/dns_records", nil, rec, nil); err != nil {
			return nil, fmt.Errorf("create %s record %s: %w", rec.Type, rec.Name, err)
		}
	}
	return recs, nil
}

// DeleteRecords removes the records of zone matching recs by name, type
// and value.
func (p *cloudflare) DeleteRecords(ctx context.Context, zone string, recs []libdns.Record) ([]libdns.Record, error) {
	id, err := p.zoneID(ctx, zone)
	if err != nil {
		return nil, err
	}
	for _, r := range recs {
		rec := p.toRecord(r.RR(), zone)
		q := url.Values{"type": {rec.Type}, "name": {rec.Name}, "content": {rec.Content}}
		var found []cfRecord
		if err := p.do(ctx, p.apiToken, http.MethodGet, "/zones/"+id+"/dns_records", q, nil, &found); err != nil {
			return nil, fmt.Errorf("find %s record %s: %w", rec.Type, rec.Name, err)
		}
		for _, f := range found {
			if err := p.do(ctx, p.apiToken, http.MethodDelete, "/zones/"+id+"/dns_records/"+f.ID, nil, nil, nil); err != nil {
				return nil, fmt.Errorf("delete %s record %s: %w", rec.Type, rec.Name, err)
			}
		}
	}
	return recs, nil
}

func (p *cloudflare) toRecord(r libdns.RR, zone string) cfRecord {
	ttl := int(r.TTL / time.Second)
	if ttl < 60 {
		ttl = 1 // Cloudflare's "automatic"
	}
	name := strings.TrimSuffix(libdns.AbsoluteName(r.Name, zone), ".")
	return cfRecord{Type: r.Type, Name: name, Content: r.Data, TTL: ttl}
}

func (p *cloudflare) zoneID(ctx context.Context, zone string) (string, error) {
	name := strings.TrimSuffix(zone, ".")
	var zones []struct {
		ID string `json:"id"`
	}
	if err := p.do(ctx, p.zoneToken, http.MethodGet, "/zones", url.Values{"name": {name}}, nil, &zones); err != nil {
		return "", fmt.Errorf("look up zone %s with %s: %w", name, p.zoneTokenName(), err)
	}
	if len(zones) == 0 {
		return "", fmt.Errorf("look up zone %s: %w: not found with %s (it needs Zone.Zone:Read on the zone)", name, ErrDNSAuth, p.zoneTokenName())
	}
	return zones[0].ID, nil
}

// do calls the API and decodes the result into out (if not nil).
func (p *cloudflare) do(ctx context.Context, token, method, path string, q url.Values, body, out any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	u := p.base + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.client.Do(req)
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrDNSUnreachable, p.base, err)
	}
	defer resp.Body.Close()
	var r cfResponse
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&r); err != nil {
		return fmt.Errorf("%w: cloudflare answered %s: %w", ErrDNSUpdate, resp.Status, err)
	}
	if resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden {
		return fmt.Errorf("%w: cloudflare answered %s: %v", ErrDNSAuth, resp.Status, r.Errors)
	}
	if !r.Success || resp.StatusCode >= 300 {
		return fmt.Errorf("%w: cloudflare answered %s: %v", ErrDNSUpdate, resp.Status, r.Errors)
	}
	if out != nil && len(r.Result) > 0 {
		return json.Unmarshal(r.Result, out)
	}
	return nil
}
