//! The router's two listening ports, and everything that bounds what callers can make them do.
//! Every port is an attack surface: each one's module says who may call it, what a caller may
//! change, and how much memory callers can make the router hold.
//!
//! | port | module | who may call | may change | memory held for callers |
//! |---|---|---|---|---|
//! | `listen.grpc` | `grpc`: ext_proc ([`crate::extproc`]), Pick (`pick`), gRPC health | anyone who reaches it (with `server.tls.client_ca_file`: certificate holders) | ext_proc: its request's decision (in-flight load, session, index); Pick: nothing unless `pick_api.allow_commit` | `server.max_connections` connections (fewer under a low `RLIMIT_NOFILE`: `fds`), `server.max_extproc_streams` ext_proc streams; ext_proc messages and bodies within `server.max_buffered_body_bytes`, Pick messages within `pick_api.max_buffered_bytes`; a started message within `server.message_timeout_ms` |
//! | `listen.admin` | `admin`: `/metrics`, `/healthz`, `/readyz`, `/debug/*` | anyone who reaches it; `/debug/*` needs `admin.token` when set | nothing (explain plans only) | 512 connections (fewer under a low `RLIMIT_NOFILE`), responses written within 10 s; explain inputs within 2 × `body_limit_bytes` + 1 MiB |
//!
//! What both use: `conns` (the connection limiter: one tracker per port, evicting at its
//! cap), `fds` (both caps fitted under the file-descriptor limit), [`crate::budget`] (the body budget type, a leaf the ext_proc service reserves from too: one per caller class), `metered` (the gRPC port's request bodies read against a budget and a message deadline), `readiness` (the one readiness rule
//! `/readyz` and the gRPC health services report). `app` builds each port from its own config
//! sections and hands it what it serves from.

pub(crate) mod admin;
pub(crate) mod authority;
pub(crate) mod conns;
pub(crate) mod fds;
pub(crate) mod grpc;
pub(crate) mod metered;
pub(crate) mod pick;
pub(crate) mod readiness;
pub(crate) mod tls;
