package agent

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"strings"
	"syscall"
)

// hint turns the error of a failed connection into what a person can do
// about it, naming the flag to pass or the address to check; "" when the
// agent can only retry (the edge restarting, a network that dropped).
func (a *Agent) hint(err error) string {
	var (
		unknownCA x509.UnknownAuthorityError
		badName   x509.HostnameError
		invalid   x509.CertificateInvalidError
		dns       *net.DNSError
		record    tls.RecordHeaderError
		ne        net.Error
	)
	switch {
	case err == nil:
		return ""
	case errors.As(err, &unknownCA):
		return a.untrustedHint()
	case errors.As(err, &badName):
		return serverNameHint(badName)
	case errors.As(err, &invalid) && invalid.Reason == x509.Expired:
		return "the edge's certificate has expired, or this machine's clock is wrong: check the clock, then the edge's certificates (its /healthz says why)"
	case errors.As(err, &dns):
		return fmt.Sprintf("the name %s did not resolve (%s): check the host of --edge", dns.Name, dnsReason(dns))
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Sprintf("is the edge running at %s? Nothing is listening there (--edge is the edge's --control-addr)", a.cfg.Edge)
	case errors.As(err, &record):
		return fmt.Sprintf("%s answered, but not with TLS: --edge must be the edge's --control-addr (port 4443 by default), not a visitor port", a.cfg.Edge)
	case errors.As(err, &ne) && ne.Timeout() && strings.HasPrefix(err.Error(), "dial "):
		return fmt.Sprintf("no answer from %s within --dial-timeout %s: is the address right, and does a firewall let it through?", a.cfg.Edge, a.cfg.DialTimeout)
	}
	return ""
}

// untrustedHint says which CA to trust.
func (a *Agent) untrustedHint() string {
	where := "an edge in self-signed mode writes its CA to ca.pem in its --data-dir (/data/ca.pem in the Docker image)"
	if a.cfg.CAFile != "" {
		return fmt.Sprintf("the edge's certificate is not signed by the CA in --ca-file %s: pass this edge's own CA (%s; a new data directory makes a new CA)", a.cfg.CAFile, where)
	}
	return fmt.Sprintf("the edge's certificate is signed by a CA this machine does not trust: pass --ca-file with the edge's CA (%s), or --insecure to skip the check while testing", where)
}

// serverNameHint names a name the edge's certificate holds.
func serverNameHint(e x509.HostnameError) string {
	names := certNames(e.Certificate)
	if len(names) == 0 {
		return fmt.Sprintf("the edge's certificate is not for %s: pass --server-name with the name it serves", e.Host)
	}
	suggest := names[0]
	for _, n := range names {
		if !strings.HasPrefix(n, "*.") && n != "localhost" && net.ParseIP(n) == nil {
			suggest = n
			break
		}
	}
	return fmt.Sprintf("the edge's certificate is for %s, not %s: pass --server-name %s (or give --edge by that name)", strings.Join(names, ", "), e.Host, suggest)
}

// certNames lists the names and addresses c is valid for.
func certNames(c *x509.Certificate) []string {
	if c == nil {
		return nil
	}
	names := append([]string(nil), c.DNSNames...)
	for _, ip := range c.IPAddresses {
		names = append(names, ip.String())
	}
	return names
}

func dnsReason(e *net.DNSError) string {
	switch {
	case e.IsNotFound:
		return "no such host"
	case e.IsTimeout:
		return "the DNS server did not answer"
	}
	return e.Err
}
