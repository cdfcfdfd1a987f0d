// Package deploy holds what runs and watches fabricbridge beyond a shell:
// the container image's Containerfile, an example Kubernetes DaemonSet, a
// Grafana dashboard and Prometheus alerting rules. Its Go code reads the
// dashboard and the rules back so that tests can hold them to what a
// running daemon exports.
package deploy

import (
	"embed"
	"encoding/json"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Paths of the dashboard and the alerting rules in this directory.
const (
	Dashboard = "grafana/fabricbridge.json"
	Alerts    = "prometheus/alerts.yaml"
)

//go:embed grafana/fabricbridge.json prometheus/alerts.yaml
var files embed.FS

// Expressions returns every PromQL expression of the dashboard (panel
// targets, template queries, annotations) and of the alerting rules,
// each prefixed with where it is.
func Expressions() (map[string]string, error) {
	out := map[string]string{}
	b, err := files.ReadFile(Dashboard)
	if err != nil {
		return nil, err
	}
	var dash any
	if err := json.Unmarshal(b, &dash); err != nil {
		return nil, fmt.Errorf("%s: %w", Dashboard, err)
	}
	walkJSON(dash, Dashboard, out)

	if b, err = files.ReadFile(Alerts); err != nil {
		return nil, err
	}
	var rules struct {
		Groups []struct {
			Name  string
			Rules []struct {
				Alert, Record, Expr string
			}
		}
	}
	if err := yaml.Unmarshal(b, &rules); err != nil {
		return nil, fmt.Errorf("%s: %w", Alerts, err)
	}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			out[fmt.Sprintf("%s: %s/%s%s", Alerts, g.Name, r.Alert, r.Record)] = r.Expr
		}
	}
	return out, nil
}

// walkJSON finds Grafana's query fields: "expr" in targets and
// annotations, "query" (a string, or an object holding one) and
// "definition" in template variables.
func walkJSON(v any, at string, out map[string]string) {
	switch v := v.(type) {
	case map[string]any:
		if v["type"] == "datasource" {
			return // its "query" names a data source plugin, not a series
		}
		for k, x := range v {
			where := at + "." + k
			if s, ok := x.(string); ok && (k == "expr" || k == "query" && strings.Contains(at, "templating") || k == "definition") {
				out[where] = s
				continue
			}
			walkJSON(x, where, out)
		}
	case []any:
		for i, x := range v {
			walkJSON(x, fmt.Sprintf("%s[%d]", at, i), out)
		}
	}
}

// MetricNames returns the metric names the expressions use, each with
// one place that uses it.
func MetricNames() (map[string]string, error) {
	exprs, err := Expressions()
	if err != nil {
		return nil, err
	}
	names := map[string]string{}
	for _, where := range slices.Sorted(maps.Keys(exprs)) {
		for _, n := range metricNames(exprs[where]) {
			if _, seen := names[n]; !seen {
				names[n] = where
			}
		}
	}
	return names, nil
}

var (
	promStrings  = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|` + "`[^`]*`")
	promMatchers = regexp.MustCompile(`\{[^}]*\}|\[[^\]]*\]`)
	labelValues  = regexp.MustCompile(`label_values\(\s*([^,)]*)(?:,[^)]*)?\)`)
	promGrouping = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	promIdent    = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)
	promKeywords = map[string]bool{"and": true, "or": true, "unless": true, "bool": true, "offset": true,
		"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
		"inf": true, "nan": true, "Inf": true, "NaN": true}
)

// metricNames picks the metric names out of a PromQL expression (or a
// Grafana label_values query): the identifiers that are not functions,
// keywords, label names in matchers or groupings, or durations.
func metricNames(expr string) []string {
	s := promStrings.ReplaceAllString(expr, `""`)
	s = labelValues.ReplaceAllString(s, "$1")
	s = promMatchers.ReplaceAllString(s, " ")
	s = promGrouping.ReplaceAllString(s, " ")
	var out []string
	for _, m := range promIdent.FindAllStringIndex(s, -1) {
		id := s[m[0]:m[1]]
		rest := strings.TrimLeft(s[m[1]:], " \t\n")
		switch {
		case promKeywords[id], strings.HasPrefix(rest, "("):
		case m[0] > 0 && (s[m[0]-1] >= '0' && s[m[0]-1] <= '9' || s[m[0]-1] == '.' || s[m[0]-1] == '$'):
			// A number's exponent or a duration's unit (1e9, 5m), or a
			// Grafana variable.
		default:
			if !slices.Contains(out, id) {
				out = append(out, id)
			}
		}
	}
	return out
}
