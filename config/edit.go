package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/spf13/pflag"
	"go.yaml.in/yaml/v3"
)

// `ngstone config` edits the agent's settings file in place: one top-level
// key at a time, keeping the file's other keys, its tunnels: and its
// comments, and writing it whole or not at all (a temporary file beside
// it, synced, renamed over it), with mode 0600 since it holds the token.

// maxSettingsFile bounds the settings file `ngstone config` reads.
const maxSettingsFile = 1 << 20

// ErrNoFile: the settings file does not exist.
var ErrNoFile = errors.New("no settings file")

// SetAgentSetting sets key, a flag of `ngstone http`, to values in the
// settings file at path, creating the file (and its directory) if need
// be. Each value is checked as the flag checks it; a repeatable flag takes
// several, the others one.
func SetAgentSetting(path, key string, values []string) error {
	f, err := agentFlag(key)
	if err != nil {
		return err
	}
	_, list := f.Value.(pflag.SliceValue)
	switch {
	case len(values) == 0:
		return fmt.Errorf("%s: give a value", key)
	case len(values) > 1 && !list:
		return fmt.Errorf("%s takes one value, got %d", key, len(values))
	}
	for i, v := range values {
		if strings.HasSuffix(key, "-file") && v != "" {
			// The file is read from wherever the agent runs next.
			abs, err := filepath.Abs(v)
			if err != nil {
				return fmt.Errorf("%s %q: %w", key, v, err)
			}
			values[i] = abs
		}
		if err := f.Value.Set(v); err != nil {
			return fmt.Errorf("%s %q: %w", key, v, err)
		}
	}
	val := &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: values[0]}
	switch {
	case list:
		val = &yaml.Node{Kind: yaml.SequenceNode, Tag: "!!seq"}
		for _, v := range values {
			val.Content = append(val.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: v})
		}
	case f.Value.Type() == "bool":
		val.Tag, val.Value = "!!bool", f.Value.String()
	}
	return editFile(path, true, func(root *yaml.Node) error {
		if i := keyIndex(root, key); i >= 0 {
			root.Content[i+1] = val
			return nil
		}
		root.Content = append(root.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: key}, val)
		return nil
	})
}

// UnsetAgentSetting removes key from the settings file at path.
func UnsetAgentSetting(path, key string) error {
	if _, err := agentFlag(key); err != nil {
		return err
	}
	return editFile(path, false, func(root *yaml.Node) error {
		i := keyIndex(root, key)
		if i < 0 {
			return fmt.Errorf("%s: not set in %s", key, path)
		}
		root.Content = slices.Delete(root.Content, i, i+2)
		return nil
	})
}

// CheckAgentFile loads the settings file at path as `ngstone http` and
// `ngstone start --all` would (with this process's environment) and
// returns the names of its tunnels.
func CheckAgentFile(path string) ([]string, error) {
	if _, err := os.Stat(path); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w at %s: `ngstone config add-authtoken TOKEN` or `ngstone config set KEY VALUE` writes it", ErrNoFile, path)
		}
		return nil, err
	}
	loader := func() *Agent {
		fs := pflag.NewFlagSet("check", pflag.ContinueOnError)
		a := NewAgent(fs)
		fs.Set("config", path)
		return a
	}
	entries, err := readTunnelEntries(path)
	if err != nil {
		return nil, err
	}
	if len(entries) == 0 {
		a := loader()
		_, _, err := a.load()
		if err == nil {
			_, err = a.Console()
		}
		return nil, err
	}
	cfg, _, err := loader().LoadTunnels(nil, true)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, t := range cfg.Tunnels {
		names = append(names, t.Name)
	}
	return names, nil
}

// AgentKeys are the keys `ngstone config set` takes: the flags of
// `ngstone http`.
func AgentKeys() []string {
	fs := pflag.NewFlagSet("keys", pflag.ContinueOnError)
	NewAgent(fs)
	var keys []string
	fs.VisitAll(func(f *pflag.Flag) {
		if f.Name != "config" && !f.Hidden {
			keys = append(keys, f.Name)
		}
	})
	return keys
}

// agentFlag is key's flag of `ngstone http`, on a flag set of its own.
func agentFlag(key string) (*pflag.Flag, error) {
	fs := pflag.NewFlagSet("set", pflag.ContinueOnError)
	NewAgent(fs)
	f := fs.Lookup(key)
	if f == nil || key == "config" {
		return nil, fmt.Errorf("unknown key %q: the keys are ngstone http's flags: %s", key, strings.Join(AgentKeys(), ", "))
	}
	return f, nil
}

// keyIndex is the index of key's node in the mapping root, or -1.
func keyIndex(root *yaml.Node, key string) int {
	for i := 0; i+1 < len(root.Content); i += 2 {
		if root.Content[i].Value == key {
			return i
		}
	}
	return -1
}

// editFile applies edit to the top-level mapping of the YAML file at path
// (an empty one when the file is absent and create allows it) and writes
// the result atomically.
func editFile(path string, create bool, edit func(root *yaml.Node) error) error {
	if resolved, err := filepath.EvalSymlinks(path); err == nil {
		path = resolved // edit the file a link points to, keep the link
	}
	b, err := readSmall(path)
	switch {
	case errors.Is(err, fs.ErrNotExist) && create:
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%w at %s", ErrNoFile, path)
	case err != nil:
		return err
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	if doc.Kind == 0 || len(doc.Content) == 0 {
		doc = yaml.Node{Kind: yaml.DocumentNode, Content: []*yaml.Node{{Kind: yaml.MappingNode, Tag: "!!map"}}}
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return fmt.Errorf("config %s: want a mapping of keys to settings at the top (line %d)", path, root.Line)
	}
	if err := edit(root); err != nil {
		return err
	}
	var out bytes.Buffer
	enc := yaml.NewEncoder(&out)
	enc.SetIndent(2)
	if err := enc.Encode(&doc); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	if err := enc.Close(); err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	return writeAtomic(path, out.Bytes())
}

func readSmall(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxSettingsFile+1))
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	if len(b) > maxSettingsFile {
		return nil, fmt.Errorf("config %s: larger than %d bytes; is it the settings file?", path, maxSettingsFile)
	}
	return b, nil
}

// writeAtomic replaces path by data, mode 0600: a reader sees the old file
// or the new one, never a part, and a crash leaves one of the two.
func writeAtomic(path string, data []byte) (err error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	defer func() {
		if err != nil {
			os.Remove(tmp.Name())
		}
	}()
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return fmt.Errorf("config: %w", err)
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("config: write %s: %w", tmp.Name(), err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("config: sync %s: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("config: %w", err)
	}
	// The rename is durable once the directory is.
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}
