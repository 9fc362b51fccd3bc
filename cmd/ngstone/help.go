package main

import (
	"errors"
	"fmt"
	"runtime"
	"strings"

	"github.com/agnivade/levenshtein"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/ngstone/ngstone/config"
)

func init() {
	cobra.AddTemplateFunc("groupedFlags", groupedFlags)
}

// groupFlagsInHelp lists cmd's flags in --help by their config.FlagGroup
// sections instead of one alphabetical list.
func groupFlagsInHelp(cmd *cobra.Command) {
	t := cmd.UsageTemplate()
	const flat = "\n\nFlags:\n{{.LocalFlags.FlagUsages | trimTrailingWhitespaces}}"
	if !strings.Contains(t, flat) {
		panic("cobra's usage template changed: the edge's --help would not be grouped")
	}
	cmd.SetUsageTemplate(strings.Replace(t, flat, "{{groupedFlags .LocalFlags}}", 1))
}

// groupedFlags renders fs as sections: the general flags first, then one
// section per group of config.FlagGroups.
func groupedFlags(fs *pflag.FlagSet) string {
	sections := map[string]*pflag.FlagSet{}
	fs.VisitAll(func(f *pflag.Flag) {
		name := "Flags"
		if g := f.Annotations[config.FlagGroup]; len(g) > 0 {
			name = g[0] + " flags"
		}
		if sections[name] == nil {
			sections[name] = pflag.NewFlagSet(name, pflag.ContinueOnError)
			sections[name].SortFlags = fs.SortFlags
		}
		sections[name].AddFlag(f)
	})
	var b strings.Builder
	for _, name := range append([]string{"Flags"}, groupNames()...) {
		if s := sections[name]; s != nil && s.HasAvailableFlags() {
			fmt.Fprintf(&b, "\n\n%s:\n%s", name, strings.TrimRight(s.FlagUsages(), " \n"))
		}
	}
	return b.String()
}

func groupNames() []string {
	var out []string
	for _, g := range config.FlagGroups {
		out = append(out, g+" flags")
	}
	return out
}

// suggestFlag turns pflag's "unknown flag: --subdomian" into a sentence
// that names the closest flag of cmd, if one is close.
func suggestFlag(cmd *cobra.Command, err error) error {
	msg := err.Error()
	name, ok := strings.CutPrefix(msg, "unknown flag: --")
	if !ok {
		return withCode(exitUsage, err)
	}
	name, _, _ = strings.Cut(name, "=")
	if s := closestFlag(cmd.Flags(), name); s != "" {
		return withCode(exitUsage, fmt.Errorf("unknown flag --%s: did you mean --%s? (ngstone %s --help lists them)", name, s, cmd.Name()))
	}
	return withCode(exitUsage, fmt.Errorf("unknown flag --%s (ngstone %s --help lists them)", name, cmd.Name()))
}

// closestFlag is the visible flag of fs nearest to name: within two edits,
// or one name begins with the other.
func closestFlag(fs *pflag.FlagSet, name string) string {
	best, bestD := "", 3
	fs.VisitAll(func(f *pflag.Flag) {
		if f.Hidden {
			return
		}
		d := levenshtein.ComputeDistance(name, f.Name)
		if len(name) >= 3 && strings.HasPrefix(f.Name, name) {
			d = min(d, 1)
		}
		if d < bestD || (d == bestD && f.Name < best) {
			best, bestD = f.Name, d
		}
	})
	return best
}

// httpArgs wants the one local service of `ngstone http`, and says how to
// give it.
func httpArgs(_ *cobra.Command, args []string) error {
	switch len(args) {
	case 1:
		return nil
	case 0:
		return withCode(exitUsage, errors.New("missing PORT: give the local service to put online, e.g. `ngstone http 3000` (or HOST:PORT, or a URL such as https://localhost:8443)"))
	}
	return withCode(exitUsage, fmt.Errorf("one local service at a time: got %d (%s); e.g. `ngstone http 3000`", len(args), strings.Join(args, ", ")))
}

// versionLine is what `ngstone version` and `ngstone --version` print.
func versionLine() string {
	return fmt.Sprintf("ngstone %s (commit %s, %s, %s/%s)", version, buildCommit(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
