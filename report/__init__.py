"""Pictures and reports of a plan, torch-free: `explain` (Gantt, memory per stage, bottleneck, HTML), `traffic`
(bytes by dimension and link class, rail-only check, heatmap), `traffic_calc`, and the tables the CLI prints.

Functions are named like the commands they serve; the CLI parses flags, calls them and prints what they return.
matplotlib is imported only by the functions that draw."""

from report.explanation import Explanation, explain
from report.network import RailOnly, TrafficReport, rail_only, traffic, traffic_calc

__all__ = ["Explanation", "RailOnly", "TrafficReport", "explain", "rail_only", "traffic", "traffic_calc"]
