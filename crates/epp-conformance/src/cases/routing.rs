//! Where requests land: normal routing, the GIE selection hook and its served-endpoint headers,
//! the subset hint, and client-forged routing headers.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use super::{check_names, list, CaseRes, Ctx, POOL, SELECTED, SELECTION, SERVED, SUBSET};

fn sel(v: impl Into<String>) -> Vec<(&'static str, String)> {
    vec![(SELECTION, v.into())]
}

/// Header absent: normal routing, any pod.
pub async fn no_selection(ctx: &Ctx) -> CaseRes {
    let seen = ctx.all_on(&[], &ctx.pods.all(), 3).await?;
    Ok(format!(
        "served by {}",
        list(&seen.into_iter().collect::<Vec<_>>())
    ))
}

/// The picker reports the served endpoint (from Envoy's `envoy.lb` metadata) in
/// `x-conformance-test-served-endpoint`; the selected endpoint and the pool, when reported, agree.
pub async fn served_endpoint(ctx: &Ctx) -> CaseRes {
    let mut notes = BTreeSet::new();
    for _ in 0..3 {
        let r = ctx.complete(&[]).await?;
        let pod = ctx.served(&r)?;
        let Some(served) = r.header(SERVED) else {
            return Err(format!(
                "no {SERVED} response header (the picker, with its conformance hooks on, copies \
                 envoy.lb x-gateway-destination-endpoint-served into it at response headers)"
            ));
        };
        check_names(SERVED, served, pod)?;
        match r.header(SELECTED) {
            Some(v) => {
                check_names(SELECTED, v, pod)?;
                notes.insert(format!("{SELECTED} agrees"));
            }
            None => {
                notes.insert(format!("no {SELECTED}"));
            }
        }
        match r.header(POOL) {
            Some(v) => match v.split_once('/') {
                Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                    notes.insert(format!("pool {v}"));
                }
                _ => return Err(format!("{POOL} is {v:?}, expected namespace/name")),
            },
            None => {
                notes.insert(format!("no {POOL}"));
            }
        }
    }
    Ok(notes.into_iter().collect::<Vec<_>>().join(", "))
}

/// `ip:port` selects exactly that endpoint, including one port of a pod with two.
pub async fn selection_ip_port(ctx: &Ctx) -> CaseRes {
    let p = &ctx.pods;
    for target in [p.a, p.c2, p.c1] {
        ctx.all_on(&sel(target.to_string()), &[target], 3).await?;
    }
    Ok(format!("{}, {} and {} each exactly", p.a, p.c2, p.c1))
}

/// A bare `ip` selects every port of that IP: only those serve, and both do.
pub async fn selection_ip(ctx: &Ctx) -> CaseRes {
    let p = &ctx.pods;
    let ip = p.c1.ip().to_string();
    let allowed = [p.c1, p.c2];
    let mut seen = BTreeSet::new();
    for n in 0..32u64 {
        let r = ctx
            .complete_body(&super::completion(Some(n)), &sel(ip.clone()))
            .await?;
        let pod = ctx.served(&r)?;
        if !allowed.contains(&pod) {
            return Err(format!("with {SELECTION}: {ip} served by {pod}"));
        }
        seen.insert(pod);
        if seen.len() == 2 && n >= 3 {
            return Ok(format!("both ports of {ip} served ({} requests)", n + 1));
        }
    }
    Err(format!(
        "with {SELECTION}: {ip} only {} served 32 distinct prompts: an IP selects every port of it",
        list(&seen.into_iter().collect::<Vec<_>>())
    ))
}

/// A list selects within the list (spaces allowed, `ip` and `ip:port` mixed).
pub async fn selection_list(ctx: &Ctx) -> CaseRes {
    let p = &ctx.pods;
    let one = ctx
        .all_on(&sel(format!("{}, {}", p.a, p.b)), &[p.a, p.b], 4)
        .await?;
    let two = ctx
        .all_on(
            &sel(format!("{},{}", p.b, p.c1.ip())),
            &[p.b, p.c1, p.c2],
            4,
        )
        .await?;
    Ok(format!("served by {} and {}", list(&v(one)), list(&v(two))))
}

fn v(s: BTreeSet<SocketAddr>) -> Vec<SocketAddr> {
    s.into_iter().collect()
}

/// IPv6 entries: `[ip]:port`, a bare `ip` and a bracketed `[ip]`.
pub async fn selection_ipv6(ctx: &Ctx) -> CaseRes {
    let Some(v6) = ctx.pods.v6 else {
        return Ok("no IPv6 pod".into());
    };
    let ip = v6.ip().to_string();
    let forms = [v6.to_string(), ip.clone(), format!("[{ip}]")];
    for f in &forms {
        ctx.all_on(&sel(f.clone()), &[v6], 2).await?;
    }
    Ok(format!("{} all select {v6}", forms.join(", ")))
}

/// No endpoint matches: refused, never served (a right IP with a wrong port matches nothing).
pub async fn selection_no_match(ctx: &Ctx) -> CaseRes {
    let wrong_port = SocketAddr::new(ctx.pods.a.ip(), 1);
    let mut codes = Vec::new();
    for v in ["127.0.0.9:8000".to_string(), wrong_port.to_string()] {
        codes.push(format!("{v} -> {}", ctx.refused(&sel(v.clone())).await?));
    }
    Ok(codes.join(", "))
}

fn subset(addrs: &[SocketAddr]) -> Vec<(&'static str, String)> {
    vec![(SUBSET, list(addrs).replace(' ', ""))]
}

/// The gateway's subset hint names every pod: any pod serves.
pub async fn subset_full(ctx: &Ctx) -> CaseRes {
    let all = ctx.pods.all();
    let seen = ctx.all_on(&subset(&all), &all, 3).await?;
    Ok(format!("served by {}", list(&v(seen))))
}

/// The subset hint names some pods: only those serve.
pub async fn subset_partial(ctx: &Ctx) -> CaseRes {
    let p = &ctx.pods;
    let seen = ctx.all_on(&subset(&[p.a, p.b]), &[p.a, p.b], 4).await?;
    let only = ctx.all_on(&subset(&[p.b]), &[p.b], 2).await?;
    Ok(format!(
        "served by {} and {}",
        list(&v(seen)),
        list(&v(only))
    ))
}

/// The subset hint names no pod of the pool: refused.
pub async fn subset_none(ctx: &Ctx) -> CaseRes {
    let bogus: SocketAddr = "127.0.0.9:8000".parse().expect("static");
    let code = ctx.refused(&subset(&[bogus])).await?;
    Ok(format!("{code}"))
}

/// A client's `x-gateway-destination-endpoint` naming pod B never steers: with the selection
/// restricted to pod A, every request lands on A.
pub async fn forged_destination(ctx: &Ctx) -> CaseRes {
    let p = &ctx.pods;
    let mut h = sel(p.a.to_string());
    h.push(("x-gateway-destination-endpoint", p.b.to_string()));
    ctx.all_on(&h, &[p.a], 3).await?;
    let mut h = sel(p.c1.to_string());
    h.push((
        "x-gateway-destination-endpoint",
        format!("{},{}", p.c2, p.b),
    ));
    ctx.all_on(&h, &[p.c1], 3).await?;
    Ok("every request served where the picker chose".into())
}

/// A client's `x-prefiller-host-port` (the disaggregation prefill header) never reaches the
/// pod: the stub pods honour it (they prefill remotely and say so in x-vllm-sim-prefilled-by).
pub async fn forged_prefiller(ctx: &Ctx) -> CaseRes {
    let p = &ctx.pods;
    let mut h = sel(p.a.to_string());
    h.push(("x-prefiller-host-port", p.b.to_string()));
    for _ in 0..3 {
        let r = ctx.complete(&h).await?;
        let pod = ctx.served(&r)?;
        if pod != p.a {
            return Err(format!("with {SELECTION}: {} served by {pod}", p.a));
        }
        if let Some(by) = r.header("x-vllm-sim-prefilled-by") {
            return Err(format!(
                "the client's x-prefiller-host-port reached pod {pod}, which had {by} prefill the prompt"
            ));
        }
    }
    Ok("the forged prefill header never reached a pod".into())
}
