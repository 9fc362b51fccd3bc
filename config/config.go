// Package config fills edge.Config and agent.Config from, in order of
// precedence, command-line flags, NGSTONE_* environment variables, the YAML
// file named by --config, and defaults.
//
// Invariant: every flag is also an environment variable (NGSTONE_ + the flag
// upper-cased, '-' as '_') and a key of the file, and every value is checked
// when loaded: a bad value is an error naming the key and the value, never a
// silent zero. It is the only package that imports viper.
package config

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cast"
	"github.com/spf13/pflag"
	"github.com/spf13/viper"
)

// EnvPrefix prefixes every environment variable.
const EnvPrefix = "NGSTONE"

// Log is the logging configuration shared by both commands.
type Log struct {
	// Format is "text", "json", or "" for text on a terminal, JSON otherwise.
	Format string
	// Level is debug, info, warn or error; "" means info.
	Level string
}

// FlagGroup is the annotation of a flag that names its section of the
// command's --help; a flag without one is in the general section.
const FlagGroup = "ngstone_help_group"

// FlagGroups are the sections of `ngstone edge --help`, in order.
var FlagGroups = []string{"Visitors", "TLS", "Agents", "Cluster", "Limits", "Admin"}

// group puts flags in the --help section name.
func group(fs *pflag.FlagSet, name string, flags ...string) {
	for _, f := range flags {
		if err := fs.SetAnnotation(f, FlagGroup, []string{name}); err != nil {
			panic("config: group " + name + ": " + err.Error()) // a flag renamed without its group
		}
	}
}

// loader reads one command's settings.
type loader struct {
	v    *viper.Viper
	fs   *pflag.FlagSet
	keys []string
	// defaultFile is read when --config names none, if it exists (the
	// agent's, in the user config directory); empty: none.
	defaultFile string
	// sections are keys of the file whose contents another reader checks
	// (the agent's tunnels:).
	sections []string
	// file is the file read, once bound; empty: none.
	file string
}

func newLoader(fs *pflag.FlagSet) *loader {
	fs.String("config", "", "YAML file of settings (keys are the flag names)")
	fs.String("log-format", "", "log format: text or json (default: text on a terminal, json otherwise)")
	fs.String("log-level", "info", "log level: debug, info, warn or error")
	return &loader{v: viper.New(), fs: fs}
}

// bind makes every flag of fs a viper key with its default, so that
// environment variables are seen for all of them.
func (l *loader) bind() error {
	l.v.SetEnvPrefix(EnvPrefix)
	l.v.SetEnvKeyReplacer(strings.NewReplacer("-", "_"))
	l.v.AutomaticEnv()
	// A variable set to nothing is set: NGSTONE_HTTPS_ADDR= disables the
	// listener, as --https-addr= does. Where nothing is not a value (a
	// duration, a number, a boolean), it is an error naming the key.
	l.v.AllowEmptyEnv(true)
	var err error
	l.fs.VisitAll(func(f *pflag.Flag) {
		l.keys = append(l.keys, f.Name)
		l.v.SetDefault(f.Name, defaultValue(f))
		if e := l.v.BindPFlag(f.Name, f); e != nil && err == nil {
			err = e
		}
	})
	if err != nil {
		return err
	}
	return l.readFile()
}

func defaultValue(f *pflag.Flag) any {
	if sv, ok := f.Value.(pflag.SliceValue); ok {
		return sv.GetSlice()
	}
	if f.Value.Type() == "stringToString" {
		return map[string]string{}
	}
	return f.DefValue
}

// readFile merges the --config file, refusing keys that are not flags so a
// typo is an error rather than a setting silently ignored.
func (l *loader) readFile() error {
	path := l.v.GetString("config")
	if path == "" && l.defaultFile != "" {
		if _, err := os.Stat(l.defaultFile); err == nil {
			path = l.defaultFile
		}
	}
	if path == "" {
		return nil
	}
	l.file = path
	l.v.SetConfigFile(path)
	l.v.SetConfigType("yaml")
	if err := l.v.ReadInConfig(); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	fileV := viper.New()
	fileV.SetConfigFile(path)
	fileV.SetConfigType("yaml")
	if err := fileV.ReadInConfig(); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	for _, k := range fileV.AllKeys() {
		if section, _, _ := strings.Cut(k, "."); slices.Contains(l.sections, section) {
			continue
		}
		if !slices.Contains(l.keys, k) || k == "config" {
			return fmt.Errorf("config %s: unknown key %q (keys are the command's flag names, e.g. drain-timeout)", path, k)
		}
	}
	return nil
}

func (l *loader) string(key string) string {
	return strings.TrimSpace(cast.ToString(l.v.Get(key)))
}

func (l *loader) duration(key string) (time.Duration, error) {
	raw := l.v.Get(key)
	d, err := cast.ToDurationE(raw)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("%s %q: want a non-negative duration such as 500ms, 10s or 1m", key, fmt.Sprint(raw))
	}
	switch v := raw.(type) {
	case string:
		if _, perr := time.ParseDuration(v); perr != nil && v != "" && v != "0" {
			return 0, fmt.Errorf("%s %q: want a duration with a unit, such as 500ms, 10s or 1m", key, v)
		}
	case int, int64, float64:
		// A bare number in a YAML file would silently mean nanoseconds.
		if d != 0 {
			return 0, fmt.Errorf("%s %q: want a duration with a unit, such as 500ms, 10s or 1m", key, fmt.Sprint(v))
		}
	}
	return d, nil
}

func (l *loader) bool(key string) (bool, error) {
	raw := l.v.Get(key)
	b, err := cast.ToBoolE(raw)
	if err != nil {
		return false, fmt.Errorf("%s %q: want true or false", key, fmt.Sprint(raw))
	}
	return b, nil
}

func (l *loader) int(key string) (int, error) {
	raw := l.v.Get(key)
	n, err := cast.ToIntE(raw)
	if s, ok := raw.(string); ok && strings.TrimSpace(s) == "" {
		err = fmt.Errorf("empty")
	}
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s %q: want a non-negative whole number", key, fmt.Sprint(raw))
	}
	return n, nil
}

// strings reads a list given as a flag repeated, a YAML list, or an
// environment variable of comma- or space-separated values.
func (l *loader) strings(key string) []string {
	var out []string
	for _, s := range cast.ToStringSlice(l.v.Get(key)) {
		out = append(out, strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' })...)
	}
	return out
}

// wholeStrings reads a list whose items may hold commas and spaces
// (passwords, header rules, file paths): each item whole from a repeated
// flag or a YAML list; from an environment variable, one item per line.
func (l *loader) wholeStrings(key string) []string {
	if s, ok := l.v.Get(key).(string); ok {
		var out []string
		for line := range strings.Lines(s) {
			if line = strings.TrimSpace(line); line != "" {
				out = append(out, line)
			}
		}
		return out
	}
	return cast.ToStringSlice(l.v.Get(key))
}

// stringMap reads a map given as KEY=VALUE flags, a YAML mapping, or an
// environment variable of comma-separated KEY=VALUE pairs.
func (l *loader) stringMap(key string) (map[string]string, error) {
	raw := l.v.Get(key)
	if s, ok := raw.(string); ok {
		out := map[string]string{}
		for _, kv := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' }) {
			k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
			if !ok || k == "" {
				return nil, fmt.Errorf("%s %q: want KEY=VALUE pairs separated by commas", key, s)
			}
			out[k] = v
		}
		return out, nil
	}
	m, err := cast.ToStringMapStringE(raw)
	if err != nil {
		return nil, fmt.Errorf("%s: want a mapping of KEY: VALUE", key)
	}
	return m, nil
}

// secret reads key, or the file named by key-file / NGSTONE_KEY_FILE.
func (l *loader) secret(key string) (string, error) {
	if v := l.string(key); v != "" {
		return v, nil
	}
	env := EnvPrefix + "_" + strings.ToUpper(strings.ReplaceAll(key, "-", "_")) + "_FILE"
	if p := os.Getenv(env); p != "" {
		b, err := os.ReadFile(p)
		if err != nil {
			return "", fmt.Errorf("%s: %w", env, err)
		}
		return strings.TrimSpace(string(b)), nil
	}
	return "", nil
}

func (l *loader) log() (Log, error) {
	lg := Log{Format: l.string("log-format"), Level: strings.ToLower(l.string("log-level"))}
	if lg.Format != "" && lg.Format != "text" && lg.Format != "json" {
		return lg, fmt.Errorf("log-format %q: want text or json", lg.Format)
	}
	if lg.Level != "" && !slices.Contains([]string{"debug", "info", "warn", "error"}, lg.Level) {
		return lg, fmt.Errorf("log-level %q: want debug, info, warn or error", lg.Level)
	}
	return lg, nil
}

// errs collects the first error of a sequence of reads.
type errs struct{ err error }

func (e *errs) dur(l *loader, key string) time.Duration {
	d, err := l.duration(key)
	e.set(err)
	return d
}

func (e *errs) boolean(l *loader, key string) bool {
	b, err := l.bool(key)
	e.set(err)
	return b
}

func (e *errs) integer(l *loader, key string) int {
	n, err := l.int(key)
	e.set(err)
	return n
}

func (e *errs) set(err error) {
	if err != nil && e.err == nil {
		e.err = err
	}
}
