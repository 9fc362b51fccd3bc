package main

import (
	"reflect"
	"slices"
	"testing"

	"github.com/spf13/pflag"

	"github.com/ngstone/ngstone/agent"
	"github.com/ngstone/ngstone/config"
	"github.com/ngstone/ngstone/edge"
	"github.com/ngstone/ngstone/internal/tunneltest"
)

// TestOneSetOfDefaults: `ngstone http PORT`, `ngstone edge --domain D`, the
// embedded edge and the tests' agents and edges (tunneltest) all start from
// agent.DefaultConfig and edge.DefaultConfig, and differ from them only in
// what each must set (addresses, the domain, where files go). A default
// the CLI changes and the tests do not, or the other way round, fails here.
func TestOneSetOfDefaults(t *testing.T) {
	agentFS := pflag.NewFlagSet("http", pflag.ContinueOnError)
	agentLoader := config.NewAgent(agentFS)
	if err := agentFS.Parse(nil); err != nil {
		t.Fatal(err)
	}
	cliAgent, _, err := agentLoader.Load("3000")
	if err != nil {
		t.Fatal(err)
	}
	edgeFS := pflag.NewFlagSet("edge", pflag.ContinueOnError)
	edgeLoader := config.NewEdge(edgeFS)
	if err := edgeFS.Parse([]string{"--domain", tunneltest.Domain}); err != nil {
		t.Fatal(err)
	}
	cliEdge, _, err := edgeLoader.Load()
	if err != nil {
		t.Fatal(err)
	}
	edgeAt := []string{"Domain", "HTTPAddr", "HTTPSAddr", "ControlAddr", "AdminAddr", "TLS.DataDir"}
	for _, tc := range []struct {
		name    string
		got     any
		want    any
		allowed []string // the fields it must set itself
	}{
		{"ngstone http 3000", cliAgent, agent.DefaultConfig(), []string{"Tunnel.Local"}},
		{"tunneltest.AgentConfig", (&tunneltest.Edge{}).AgentConfig("127.0.0.1:1", "3000"), agent.DefaultConfig(),
			[]string{"Edge", "Tunnel.Local", "RootCAs"}},
		{"ngstone edge --domain D", cliEdge, edge.DefaultConfig(), []string{"Domain"}},
		{"tunneltest.EdgeConfig", tunneltest.EdgeConfig(t), edge.DefaultConfig(), edgeAt},
		{"the embedded edge", embeddedEdgeConfig(t.TempDir()), edge.DefaultConfig(), edgeAt},
	} {
		for _, f := range differing(tc.got, tc.want) {
			if !slices.Contains(tc.allowed, f) {
				t.Errorf("%s: %s is not the default: %v, default %v", tc.name, f, field(tc.got, f), field(tc.want, f))
			}
		}
	}
	// And the inspector is on in what the CLI runs.
	if cliAgent.InspectAddr != agent.DefaultInspectAddr || cliAgent.InspectPorts != agent.DefaultInspectPorts {
		t.Errorf("ngstone http 3000: inspector at %q (+%d ports), want %s", cliAgent.InspectAddr, cliAgent.InspectPorts, agent.DefaultInspectAddr)
	}
}

// TestDifferingFindsEachKind: differing reports a field of each kind that
// differs, nested ones by their path, and nothing for equal values.
func TestDifferingFindsEachKind(t *testing.T) {
	d := agent.DefaultConfig()
	if got := differing(d, agent.DefaultConfig()); len(got) != 0 {
		t.Errorf("equal: %v", got)
	}
	c := agent.DefaultConfig()
	c.InspectAddr, c.UpstreamTimeout, c.Mux.StreamWindow, c.Insecure = "", 1, 7, true
	c.OnStatus = func(agent.Status) {}
	c.BasicAuth = []string{"a:b"}
	d.RequestHeaderAdd = []string{} // the same as none
	want := []string{"Tunnel.UpstreamTimeout", "Tunnel.BasicAuth", "Insecure", "Mux.StreamWindow", "InspectAddr", "OnStatus"}
	got := differing(c, d)
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("differing: %v, want %v", got, want)
	}
}

// differing lists the paths of the exported fields where a and b, structs
// of one type, differ. A func field differs when one is set and the other
// not; an empty list or map is the same as none.
func differing(a, b any) []string {
	var out []string
	var walk func(path string, x, y reflect.Value)
	walk = func(path string, x, y reflect.Value) {
		switch x.Kind() {
		case reflect.Struct:
			for i := range x.NumField() {
				if f := x.Type().Field(i); f.IsExported() {
					walk(join(path, f.Name), x.Field(i), y.Field(i))
				}
			}
		case reflect.Func:
			if x.IsNil() != y.IsNil() {
				out = append(out, path)
			}
		case reflect.Slice, reflect.Map:
			if (x.Len() != 0 || y.Len() != 0) && !reflect.DeepEqual(x.Interface(), y.Interface()) {
				out = append(out, path)
			}
		default:
			if !reflect.DeepEqual(x.Interface(), y.Interface()) {
				out = append(out, path)
			}
		}
	}
	walk("", reflect.ValueOf(a), reflect.ValueOf(b))
	return out
}

func join(path, name string) string {
	if path == "" {
		return name
	}
	return path + "." + name
}

// field is the value at path in v, for messages.
func field(v any, path string) any {
	x := reflect.ValueOf(v)
	for len(path) > 0 {
		name := path
		if i := indexDot(path); i >= 0 {
			name, path = path[:i], path[i+1:]
		} else {
			path = ""
		}
		x = x.FieldByName(name)
	}
	return x.Interface()
}

func indexDot(s string) int {
	for i := range len(s) {
		if s[i] == '.' {
			return i
		}
	}
	return -1
}
