package deploy

import (
	"reflect"
	"strings"
	"testing"
)

func TestMetricNames(t *testing.T) {
	for _, c := range []struct {
		expr string
		want []string
	}{
		{`fabricbridge_ready == 0`, []string{"fabricbridge_ready"}},
		{`sum by (instance, reason) (rate(fabricbridge_queue_rx_drops_total{reason!="no_stream", instance=~"$instance"}[$__rate_interval])) * 8`,
			[]string{"fabricbridge_queue_rx_drops_total"}},
		{`a_total / on (ring) group_left(app) b == 1e9 and c offset 5m`, []string{"a_total", "b", "c"}},
		{`time() - fabricbridge_start_time_seconds{job="x{y}"}`, []string{"fabricbridge_start_time_seconds"}},
		{`label_values(fabricbridge_start_time_seconds, instance)`, []string{"fabricbridge_start_time_seconds"}},
		{`max without (mode) (x:rate5m) > bool 2`, []string{"x:rate5m"}},
	} {
		if got := metricNames(c.expr); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: %q, want %q", c.expr, got, c.want)
		}
	}
}

// TestExpressionsFound: the walk finds the dashboard's panels, variables
// and annotations and every alerting rule, not just some of them.
func TestExpressionsFound(t *testing.T) {
	exprs, err := Expressions()
	if err != nil {
		t.Fatal(err)
	}
	var dash, rules, templ, annot int
	for where := range exprs {
		switch {
		case strings.HasPrefix(where, Alerts):
			rules++
		case strings.Contains(where, "templating"):
			templ++
		case strings.Contains(where, "annotations"):
			annot++
		default:
			dash++
		}
	}
	if dash < 30 || rules < 9 || templ < 1 || annot < 1 {
		t.Errorf("found %d panel targets, %d rules, %d template queries, %d annotations:\n%v", dash, rules, templ, annot, exprs)
	}
	names, err := MetricNames()
	if err != nil {
		t.Fatal(err)
	}
	if len(names) < 25 {
		t.Errorf("%d metric names: %v", len(names), names)
	}
}
