//! CallerService: who the server takes the caller to be, read from the credentials the guard checked.
use tonic::{Request, Response, Status};

use super::pb::{self, caller_service_server::CallerService};
use crate::auth::{Caller, CredentialKind, Role};

#[derive(Clone, Debug, Default)]
pub struct CallerApi;

#[tonic::async_trait]
impl CallerService for CallerApi {
    async fn get_caller(
        &self,
        req: Request<pb::GetCallerRequest>,
    ) -> Result<Response<pb::GetCallerResponse>, Status> {
        let answer = match req.extensions().get::<Caller>() {
            Some(Caller::Known(id)) => pb::GetCallerResponse {
                authenticated: true,
                subject: id.subject.clone(),
                role: role(id.role) as i32,
                credential_kind: kind(id.kind) as i32,
                principal: id.principal.clone().unwrap_or_default(),
                expire_time: id.expires.map(|s| prost_types::Timestamp {
                    seconds: s,
                    nanos: 0,
                }),
            },
            // Authentication is off: every RPC is open, as to an admin.
            _ => pb::GetCallerResponse {
                authenticated: false,
                role: pb::CallerRole::Admin as i32,
                ..Default::default()
            },
        };
        Ok(Response::new(answer))
    }
}

fn role(r: Role) -> pb::CallerRole {
    match r {
        Role::Admin => pb::CallerRole::Admin,
        Role::Runtime => pb::CallerRole::Runtime,
        Role::Reader => pb::CallerRole::Reader,
    }
}

fn kind(k: CredentialKind) -> pb::CredentialKind {
    match k {
        CredentialKind::Token => pb::CredentialKind::Token,
        CredentialKind::Jwt => pb::CredentialKind::Jwt,
        CredentialKind::Certificate => pb::CredentialKind::Certificate,
    }
}
