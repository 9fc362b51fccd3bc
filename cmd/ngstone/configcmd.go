package main

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/ngstone/ngstone/config"
)

func newConfigCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Write the agent's settings file once, for every later run",
		Long: `Write the agent's settings file, read by ngstone http and ngstone start when
--config is not given, so that --edge, --ca-file and --authtoken are given
once:

	ngstone config add-authtoken TOKEN
	ngstone config set edge tunnels.example.com:4443
	ngstone config set ca-file /etc/ngstone/ca.pem
	ngstone http 3000

The keys are the flags of ngstone http. Flags and NGSTONE_* environment
variables still win over the file. The file is YAML, written whole or not at
all, with mode 0600 (it holds the token); its other keys, its tunnels: (see
ngstone start --help) and its comments are kept.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	path := cmd.PersistentFlags().String("config", "", "the settings file (default: "+defaultFileHelp()+")")
	file := func() (string, error) {
		if *path != "" {
			return *path, nil
		}
		p, err := config.DefaultFile()
		return p, withCode(exitUsage, err)
	}
	edit := func(do func(string) error) error {
		p, err := file()
		if err != nil {
			return err
		}
		if err := do(p); err != nil {
			return withCode(exitUsage, err)
		}
		fmt.Fprintln(cmd.OutOrStdout(), "Saved to", p)
		return nil
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "add-authtoken TOKEN",
		Short: "Save the token the agent presents to the edge",
		Args:  exactArgs(1, "the token, e.g. `ngstone config add-authtoken tok_...`"),
		RunE: func(_ *cobra.Command, args []string) error {
			return edit(func(p string) error { return config.SetAgentSetting(p, "authtoken", args) })
		},
	}, &cobra.Command{
		Use:   "set KEY VALUE...",
		Short: "Save a setting: KEY is a flag of ngstone http (several values for a repeatable one)",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) < 2 {
				return withCode(exitUsage, fmt.Errorf("want KEY VALUE, e.g. `ngstone config set edge tunnels.example.com:4443`; the keys: %s", strings.Join(config.AgentKeys(), ", ")))
			}
			return nil
		},
		RunE: func(_ *cobra.Command, args []string) error {
			if err := knownKey(args[0]); err != nil {
				return err
			}
			return edit(func(p string) error { return config.SetAgentSetting(p, args[0], args[1:]) })
		},
	}, &cobra.Command{
		Use:   "unset KEY",
		Short: "Remove a setting from the file",
		Args:  exactArgs(1, "the key to remove, e.g. `ngstone config unset ca-file`"),
		RunE: func(_ *cobra.Command, args []string) error {
			if err := knownKey(args[0]); err != nil {
				return err
			}
			return edit(func(p string) error { return config.UnsetAgentSetting(p, args[0]) })
		},
	}, &cobra.Command{
		Use:   "check",
		Short: "Load the settings file as ngstone http and ngstone start would, and say what is wrong",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			p, err := file()
			if err != nil {
				return err
			}
			names, err := config.CheckAgentFile(p)
			if err != nil {
				return withCode(exitUsage, err)
			}
			fmt.Fprintln(cmd.OutOrStdout(), "Valid settings file at", p)
			if len(names) > 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "Tunnels (ngstone start --all):", strings.Join(names, ", "))
			}
			return nil
		},
	})
	return cmd
}

// knownKey refuses a key that is no flag of ngstone http, naming the
// closest one.
func knownKey(key string) error {
	if slices.Contains(config.AgentKeys(), key) {
		return nil
	}
	if s := closestFlag(newHTTPCmd().Flags(), key); s != "" {
		return withCode(exitUsage, fmt.Errorf("unknown key %q: did you mean %s? (the keys are the flags of ngstone http --help)", key, s))
	}
	return withCode(exitUsage, fmt.Errorf("unknown key %q: the keys are the flags of ngstone http: %s", key, strings.Join(config.AgentKeys(), ", ")))
}

// defaultFileHelp names the default settings file in --help.
func defaultFileHelp() string {
	if p, err := config.DefaultFile(); err == nil {
		return p
	}
	return "ngstone/ngstone.yml in the user config directory"
}

// exactArgs wants n arguments, and says what they are when they are not.
func exactArgs(n int, what string) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) != n {
			return withCode(exitUsage, errors.New("want "+what))
		}
		return nil
	}
}
