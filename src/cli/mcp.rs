//! `hcp-sense mcp`: the MCP door over standard input and output, for a harness that starts its tools as processes; a client of a running server, as `explain` is.
use rmcp::ServiceExt;

use super::ServerArgs;

#[derive(Debug, clap::Args)]
pub struct McpArgs {
    #[command(flatten)]
    pub server: ServerArgs,
}

/// Serves MCP on standard input and output until the client closes them. Every call goes
/// to the server with `--token`; standard output carries MCP messages only, logs go to
/// standard error.
pub async fn run(args: McpArgs) -> anyhow::Result<()> {
    let server = args.server.connect()?;
    let door = crate::mcp::Door::new(server.channel.clone(), args.server.token.as_deref())?;
    let running = door.serve(rmcp::transport::stdio()).await?;
    running.waiting().await?;
    Ok(())
}
