package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

func newHealthcheckCmd() *cobra.Command {
	var addr string
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "healthcheck",
		Short: "Exit 0 if the edge's admin /healthz answers ok (for Docker HEALTHCHECK)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if addr == "" {
				addr = os.Getenv("NGSTONE_ADMIN_ADDR")
			}
			if addr == "" {
				addr = "127.0.0.1:9180"
			}
			if err := healthcheck(cmd.Context(), addr, timeout); err != nil {
				return withCode(exitError, err)
			}
			fmt.Fprintln(cmd.OutOrStdout(), "ok")
			return nil
		},
	}
	cmd.Flags().StringVar(&addr, "admin-addr", "", "the edge's admin address (default $NGSTONE_ADMIN_ADDR or 127.0.0.1:9180)")
	cmd.Flags().DurationVar(&timeout, "timeout", 3*time.Second, "give up after this long")
	return cmd
}

func healthcheck(ctx context.Context, addr string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	host := addr
	if strings.HasPrefix(host, ":") || strings.HasPrefix(host, "0.0.0.0:") || strings.HasPrefix(host, "[::]:") {
		host = "127.0.0.1:" + host[strings.LastIndex(host, ":")+1:]
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+host+"/healthz", nil)
	if err != nil {
		return fmt.Errorf("healthcheck %s: %w", addr, err)
	}
	if tok := os.Getenv("NGSTONE_ADMIN_TOKEN"); tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("healthcheck %s: %w", addr, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64))
	if resp.StatusCode != http.StatusOK || strings.TrimSpace(string(body)) != "ok" {
		return fmt.Errorf("healthcheck %s: status %d %q", addr, resp.StatusCode, body)
	}
	return nil
}
