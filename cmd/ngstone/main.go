// Command ngstone puts a local HTTP service at a public HTTPS URL through an
// edge server you run yourself.
//
//	ngstone edge --domain tunnels.example.com     # the public server
//	ngstone http 3000                             # an agent (embedded edge when --edge is absent)
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

// Exit codes.
const (
	exitOK      = 0
	exitError   = 1 // a run-time failure
	exitUsage   = 2 // bad flags, environment or config file
	exitRefused = 3 // the edge refused the bind or the token (final)
	exitEvicted = 4 // another agent took the name over
)

// exitError carries an exit code out of a command.
type codeError struct {
	code int
	err  error
}

func (e *codeError) Error() string { return e.err.Error() }
func (e *codeError) Unwrap() error { return e.err }

func withCode(code int, err error) error {
	if err == nil {
		return nil
	}
	return &codeError{code: code, err: err}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:]))
}

func run(ctx context.Context, args []string) int {
	root := newRoot()
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return exitOK
	}
	fmt.Fprintln(os.Stderr, "ngstone:", err)
	var ce *codeError
	if errors.As(err, &ce) {
		return ce.code
	}
	return exitUsage // cobra's own errors: unknown flag, wrong arguments
}

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:           "ngstone",
		Short:         "Put a local HTTP service at a public HTTPS URL through your own edge",
		Version:       version,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetVersionTemplate(versionLine() + "\n")
	root.SetFlagErrorFunc(suggestFlag)
	root.AddCommand(newEdgeCmd(), newHTTPCmd(), newTCPCmd(), newTLSCmd(), newStartCmd(), newConfigCmd(), newVersionCmd(), newHealthcheckCmd())
	return root
}
