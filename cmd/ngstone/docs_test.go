package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// docsDir is where the user and operator documentation lives, from this
// package's directory.
const docsDir = "../../docs"

// edgeCommands are the top-level commands documented in edge.md; every
// other command is the agent's, documented in agent.md.
var edgeCommands = map[string]bool{"edge": true, "healthcheck": true}

// TestDocsFlags checks that every flag a user can see in --help is in the
// docs: an edge command's in edge.md, any other command's in agent.md.
// Cobra's own help and completion commands are not built here (they are
// added at Execute), so they are not checked.
func TestDocsFlags(t *testing.T) {
	docs := map[string]string{"edge.md": readDoc(t, "edge.md"), "agent.md": readDoc(t, "agent.md")}
	root := newRoot()
	root.InitDefaultVersionFlag()
	checked := 0
	walkCommands(root, func(cmd *cobra.Command) {
		page := "agent.md"
		if edgeCommands[topLevel(cmd)] {
			page = "edge.md"
		}
		cmd.LocalFlags().VisitAll(func(f *pflag.Flag) {
			if f.Hidden || f.Name == "help" {
				return
			}
			checked++
			if !mentionsFlag(docs[page], f.Name) {
				t.Errorf("%s: flag --%s is not in docs/%s", cmd.CommandPath(), f.Name, page)
			}
		})
	})
	if checked < 50 {
		t.Fatalf("checked %d flags: the walk of the CLI missed its commands", checked)
	}
}

// TestDocsErrorCodes checks that every code the mux package declares (the
// Ngstone-Error values and the error and bind_error codes) is in errors.md.
// The codes are read from mux's source, so a new one needs no change here.
func TestDocsErrorCodes(t *testing.T) {
	doc := readDoc(t, "errors.md")
	codes := muxCodes(t)
	if len(codes) < 20 {
		t.Fatalf("found %d codes in mux: the parse missed their declarations", len(codes))
	}
	for name, code := range codes {
		if !strings.Contains(doc, "`"+code+"`") {
			t.Errorf("mux.%s (%q) is not in docs/errors.md", name, code)
		}
	}
}

func readDoc(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(docsDir, name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func walkCommands(cmd *cobra.Command, f func(*cobra.Command)) {
	f(cmd)
	for _, c := range cmd.Commands() {
		walkCommands(c, f)
	}
}

// topLevel is the name of the root's subcommand that cmd is, or is under;
// empty for the root.
func topLevel(cmd *cobra.Command) string {
	for cmd.HasParent() && cmd.Parent().HasParent() {
		cmd = cmd.Parent()
	}
	if !cmd.HasParent() {
		return ""
	}
	return cmd.Name()
}

// mentionsFlag reports whether doc names --name itself, not only a longer
// flag it begins (--inspect, not just --inspect-addr).
func mentionsFlag(doc, name string) bool {
	return regexp.MustCompile(`--` + regexp.QuoteMeta(name) + `([^a-z0-9-]|$)`).MatchString(doc)
}

// muxCodes returns the string constants named Code... declared in mux's
// non-test files, by name.
func muxCodes(t *testing.T) map[string]string {
	t.Helper()
	files, err := filepath.Glob("../../mux/*.go")
	if err != nil {
		t.Fatal(err)
	}
	codes := map[string]string{}
	fset := token.NewFileSet()
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			addCodes(t, d, codes)
		}
	}
	return codes
}

func addCodes(t *testing.T, d ast.Decl, codes map[string]string) {
	g, ok := d.(*ast.GenDecl)
	if !ok || g.Tok != token.CONST {
		return
	}
	for _, s := range g.Specs {
		vs := s.(*ast.ValueSpec)
		for i, n := range vs.Names {
			if !strings.HasPrefix(n.Name, "Code") || i >= len(vs.Values) {
				continue
			}
			lit, ok := vs.Values[i].(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				continue
			}
			v, err := strconv.Unquote(lit.Value)
			if err != nil {
				t.Fatal(err)
			}
			codes[n.Name] = v
		}
	}
}
