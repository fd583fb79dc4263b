//! The router's two listening ports and the services behind them.
//!
//! | port | module | services |
//! |---|---|---|
//! | `listen.grpc` | [`grpc`] | Envoy ext_proc ([`crate::extproc`]), the `Pick` service ([`pick`]), gRPC health |
//! | `listen.admin` | [`admin`] | `/metrics`, `/healthz`, `/readyz`, `/debug/pods`, `POST /debug/explain` |
//!
//! Both ports bound their connections with [`conns`] and the bytes their request bodies may
//! hold with a [`budget::BodyBudget`] of their own.

pub(crate) mod admin;
pub mod budget;
pub(crate) mod conns;
pub(crate) mod grpc;
pub(crate) mod pick;
pub(crate) mod readiness;
