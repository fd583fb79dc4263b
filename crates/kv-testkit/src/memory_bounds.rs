//! The documented worst-case memory of each shipped component: the `memory-bounds` block of
//! docs/operations.md ("Memory bounds"), parsed so that the deploy test can hold the manifests'
//! limits to it and `kv-bench hostile` can report a measured RSS against it.
//!
//! The block holds one section per component:
//!
//! ```text
//! [router] deployment=kv-router container=kv-router headroom=10%
//! base        = 80 MiB              # what the term stands for
//! body_budget = 2.2 × 96 MiB        # server.max_buffered_body_bytes
//! connections = 1024 × 15 KiB       # server.max_connections
//! bound       = 766 MiB
//! ```
//!
//! A term is a product: plain numbers, then one number with a unit (B, KiB, MiB, GiB); the text
//! after `#` names where its input comes from. `bound` is the sum of the terms, rounded up.

use std::path::Path;

/// One summand of a bound.
#[derive(Debug, Clone, PartialEq)]
pub struct Term {
    pub name: String,
    /// The factors as written, the last one in bytes (`2.2 × 96 MiB` → `[2.2, 100663296]`).
    pub operands: Vec<f64>,
    /// Where the input comes from (the text after `#`, trimmed).
    pub source: String,
}

impl Term {
    /// The term's value in bytes (the product of its operands).
    pub fn bytes(&self) -> f64 {
        self.operands.iter().product()
    }
}

/// One component's documented worst case.
#[derive(Debug, Clone, PartialEq)]
pub struct Bound {
    pub component: String,
    /// The Deployments whose memory limit must hold it.
    pub deployments: Vec<String>,
    /// The container within them that runs the component.
    pub container: String,
    /// The share of the bound a limit must leave above it (0.1 = limit ≥ bound × 1.1).
    pub headroom: f64,
    pub terms: Vec<Term>,
    /// The documented bound, bytes.
    pub bound: u64,
}

const MIB: f64 = (1u64 << 20) as f64;

impl Bound {
    /// The sum of the terms, bytes.
    pub fn sum(&self) -> f64 {
        self.terms.iter().map(Term::bytes).sum()
    }

    /// The smallest memory limit that holds the bound with its headroom, bytes.
    pub fn min_limit(&self) -> u64 {
        (self.bound as f64 * (1.0 + self.headroom)).ceil() as u64
    }

    /// The term named `name`.
    pub fn term(&self, name: &str) -> Option<&Term> {
        self.terms.iter().find(|t| t.name == name)
    }

    /// Ok when the stated bound is the sum of its terms (rounded up to the MiB) and `limit`
    /// (bytes) holds it with the headroom; else why not.
    pub fn check(&self, limit: u64) -> Result<(), String> {
        let sum = self.sum();
        let bound = self.bound as f64;
        if bound + 1.0 < sum || bound >= sum + MIB {
            return Err(format!(
                "[{}]: bound {:.1} MiB is not the sum of its terms, {:.1} MiB (rounded up)",
                self.component,
                bound / MIB,
                sum / MIB
            ));
        }
        if limit < self.min_limit() {
            return Err(format!(
                "[{}]: a memory limit of {:.0} MiB is below the documented worst case {:.0} MiB + {:.0} % headroom ({:.0} MiB)",
                self.component,
                limit as f64 / MIB,
                bound / MIB,
                self.headroom * 100.0,
                self.min_limit() as f64 / MIB
            ));
        }
        Ok(())
    }
}

/// A number as the docs write it: `10,000`, `2.2`.
fn number(s: &str) -> Result<f64, String> {
    s.trim()
        .replace(',', "")
        .parse::<f64>()
        .map_err(|_| format!("not a number: `{s}`"))
}

/// `96 MiB` → bytes.
fn with_unit(s: &str) -> Result<f64, String> {
    let s = s.trim();
    let (n, unit) = s
        .rsplit_once(' ')
        .ok_or_else(|| format!("`{s}`: the last factor needs a unit (B, KiB, MiB, GiB)"))?;
    let scale = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => MIB,
        "GiB" => MIB * 1024.0,
        _ => return Err(format!("`{s}`: unknown unit `{unit}`")),
    };
    Ok(number(n)? * scale)
}

fn operands(expr: &str) -> Result<Vec<f64>, String> {
    let parts: Vec<&str> = expr.split('×').collect();
    let (last, rest) = parts.split_last().ok_or("empty term")?;
    let mut out = rest
        .iter()
        .map(|p| number(p))
        .collect::<Result<Vec<_>, _>>()?;
    out.push(with_unit(last)?);
    Ok(out)
}

fn header(line: &str) -> Result<Bound, String> {
    let (name, rest) = line
        .strip_prefix('[')
        .and_then(|l| l.split_once(']'))
        .ok_or_else(|| format!("not a section header: `{line}`"))?;
    let mut b = Bound {
        component: name.trim().to_string(),
        deployments: Vec::new(),
        container: String::new(),
        headroom: 0.0,
        terms: Vec::new(),
        bound: 0,
    };
    for kv in rest.split_whitespace() {
        match kv.split_once('=') {
            Some(("deployment", v)) => b.deployments = v.split(',').map(String::from).collect(),
            Some(("container", v)) => b.container = v.to_string(),
            Some(("headroom", v)) => {
                let pct = v.strip_suffix('%').ok_or("headroom is a percentage")?;
                b.headroom = number(pct)? / 100.0;
            }
            _ => return Err(format!("[{}]: unknown `{kv}`", b.component)),
        }
    }
    if b.deployments.is_empty() || b.container.is_empty() {
        return Err(format!(
            "[{}]: needs deployment= and container=",
            b.component
        ));
    }
    Ok(b)
}

/// Every section of the first ```` ```memory-bounds ```` block of `markdown`.
pub fn parse(markdown: &str) -> Result<Vec<Bound>, String> {
    let start = markdown
        .find("```memory-bounds\n")
        .ok_or("no ```memory-bounds block")?;
    let body = &markdown[start + "```memory-bounds\n".len()..];
    let body = &body[..body.find("```").ok_or("unterminated memory-bounds block")?];
    let mut out: Vec<Bound> = Vec::new();
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.starts_with('[') {
            out.push(header(line)?);
            continue;
        }
        let b = out
            .last_mut()
            .ok_or_else(|| format!("`{line}` before any [component]"))?;
        let (code, source) = line.split_once('#').unwrap_or((line, ""));
        let (name, expr) = code
            .split_once('=')
            .ok_or_else(|| format!("not `name = value`: `{line}`"))?;
        let name = name.trim();
        if name == "bound" {
            b.bound = with_unit(expr)?.ceil() as u64;
        } else {
            b.terms.push(Term {
                name: name.to_string(),
                operands: operands(expr)?,
                source: source.trim().to_string(),
            });
        }
    }
    if let Some(b) = out.iter().find(|b| b.bound == 0 || b.terms.is_empty()) {
        return Err(format!("[{}]: needs terms and a bound", b.component));
    }
    Ok(out)
}

/// The bounds documented in `root`/docs/operations.md.
pub fn documented(root: &Path) -> Result<Vec<Bound>, String> {
    let path = root.join("docs/operations.md");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse(&text)
}

/// A Kubernetes memory quantity (`1Gi`, `512Mi`, `1G`, `2048`) in bytes.
pub fn quantity(q: &str) -> Option<u64> {
    let q = q.trim();
    let split = q.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(q.len());
    let (n, suffix) = q.split_at(split);
    let scale: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    let n: f64 = n.parse().ok()?;
    Some((n * scale as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK: &str = "text\n```memory-bounds\n\
        [router] deployment=kv-router container=kv-router headroom=10%\n\
        base = 80 MiB # idle\n\
        body = 2.2 × 256 MiB # server.max_buffered_body_bytes\n\
        conns = 10,000 × 15 KiB # server.max_connections\n\
        bound = 788 MiB\n\
        \n\
        [envoy] deployment=envoy,envoy-round-robin container=envoy headroom=0%\n\
        heap = 320 MiB\n\
        bound = 320 MiB\n\
        ```\n";

    #[test]
    fn the_block_parses_into_sections_and_terms() {
        let b = parse(BLOCK).unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(b[0].deployments, ["kv-router"]);
        assert_eq!(b[0].headroom, 0.1);
        assert_eq!(b[0].term("conns").unwrap().operands, [10_000.0, 15_360.0]);
        assert_eq!(
            b[0].term("body").unwrap().source,
            "server.max_buffered_body_bytes"
        );
        assert_eq!(b[1].deployments, ["envoy", "envoy-round-robin"]);
        assert_eq!(b[1].bound, 320 << 20);
    }

    #[test]
    fn a_bound_that_is_not_the_sum_or_over_the_limit_fails() {
        let b = parse(BLOCK).unwrap();
        // 80 + 563.2 + 146.5 = 789.7 MiB: 788 is below the sum.
        assert!(b[0].check(4 << 30).unwrap_err().contains("not the sum"));
        assert!(b[1].check(320 << 20).is_ok());
        assert!(b[1].check((320 << 20) - 1).unwrap_err().contains("below"));
    }

    #[test]
    fn quantities_read_as_kubernetes_writes_them() {
        assert_eq!(quantity("1Gi"), Some(1 << 30));
        assert_eq!(quantity("512Mi"), Some(512 << 20));
        assert_eq!(quantity("1.5Gi"), Some(3 << 29));
        assert_eq!(quantity("1G"), Some(1_000_000_000));
        assert_eq!(quantity("2048"), Some(2048));
        assert_eq!(quantity("1Xi"), None);
    }
}
