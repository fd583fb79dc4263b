//! `GET /v1/models` as vLLM's `OpenAIServingModels.show_available_models` writes it: the base
//! models, then one card per LoRA adapter (`root` = its path, `parent` = the first base model,
//! no `max_model_len`).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use super::{hex_id, AppState};

#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: Vec<ModelCard<'a>>,
}

#[derive(Serialize)]
struct ModelCard<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    root: &'a str,
    parent: Option<&'a str>,
    max_model_len: Option<usize>,
    permission: Vec<ModelPermission>,
}

#[derive(Serialize)]
struct ModelPermission {
    id: String,
    object: &'static str,
    created: u64,
    allow_create_engine: bool,
    allow_sampling: bool,
    allow_logprobs: bool,
    allow_search_indices: bool,
    allow_view: bool,
    allow_fine_tuning: bool,
    organization: &'static str,
    group: Option<()>,
    is_blocking: bool,
}

pub(crate) async fn list_models(State(state): State<Arc<AppState>>) -> Response {
    let base = state.models[0].as_str();
    let cards = state
        .models
        .iter()
        .map(|m| (m.as_str(), m.as_str(), None, Some(state.max_model_len)))
        .chain(
            state
                .adapters
                .iter()
                .map(|a| (&*a.name, a.path.as_str(), Some(base), None)),
        );
    let data = cards
        .enumerate()
        .map(|(i, (id, root, parent, max_model_len))| ModelCard {
            id,
            object: "model",
            created: state.started,
            owned_by: "vllm",
            root,
            parent,
            max_model_len,
            permission: vec![ModelPermission {
                id: format!("modelperm-{}", hex_id(state.seed, i as u64 ^ 0x5eed)),
                object: "model_permission",
                created: state.started,
                allow_create_engine: false,
                allow_sampling: true,
                allow_logprobs: true,
                allow_search_indices: false,
                allow_view: true,
                allow_fine_tuning: false,
                organization: "*",
                group: None,
                is_blocking: false,
            }],
        })
        .collect();
    Json(ModelList {
        object: "list",
        data,
    })
    .into_response()
}
