"""What the bench scripts' reports read from a kvroute /metrics dump and from /proc."""
import re


def decisions(path):
    """kvroute_routing_seconds in the dump at `path`: (decisions, quantile), where quantile(q)
    names the bucket (powers of two from 1 us) that holds the q-th quantile, "<=Nus"."""
    buckets = []
    for line in open(path):
        m = re.match(r'kvroute_routing_seconds_bucket\{le="([^"]+)"\} (\S+)', line)
        if m:
            buckets.append((float(m.group(1)), float(m.group(2))))
    total = buckets[-1][1] if buckets else 0

    def quantile(q):
        for le, count in buckets:
            if count >= q * total:
                return "inf" if le == float("inf") else f"<={le * 1e6:.0f}us"
        return "-"

    return total, quantile


def status(pid):
    """/proc/PID/status as a dict."""
    return dict(l.split(":", 1) for l in open(f"/proc/{pid}/status") if ":" in l)
