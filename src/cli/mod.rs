//! The command-line clients of a running server (`hcp-sense pipe`, `hcp-sense explain`, `hcp-sense why`, `hcp-sense mcp`) and what they share: the server's address and token, and calls made with them.

pub mod explain_trigger;
pub mod mcp;
pub mod pipe;
pub mod why;
use std::time::Duration;

use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

/// Where the server is and who calls it.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    /// The server's gRPC address.
    #[arg(
        long,
        env = "HCP_SENSE_SERVER",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
    /// A bearer token for the server.
    #[arg(long, env = "HCP_SENSE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// A channel to the server and the authorization its calls carry.
#[derive(Debug, Clone)]
pub struct Server {
    pub channel: Channel,
    token: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl ServerArgs {
    /// Connects lazily: the first call says whether the server answers.
    pub fn connect(&self) -> anyhow::Result<Server> {
        let channel = Endpoint::from_shared(self.server.clone())?
            .connect_timeout(Duration::from_secs(5))
            .connect_lazy();
        let token = match &self.token {
            Some(t) => Some(MetadataValue::try_from(format!("Bearer {t}"))?),
            None => None,
        };
        Ok(Server { channel, token })
    }
}

impl Server {
    /// A request carrying the token, if there is one.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut call = tonic::Request::new(message);
        if let Some(t) = &self.token {
            call.metadata_mut().insert("authorization", t.clone());
        }
        call
    }
}
