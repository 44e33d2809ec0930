//! sea-orm entities for the tables the service reads and writes (schema in `migrations/`).
#![allow(missing_docs)]

pub mod packs {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "packs")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub pack_id: String,
        pub kind: String,
        pub binding_mode: String,
        pub binding_hub: Option<String>,
        pub upstream_requires_registration: bool,
        #[sea_orm(column_type = "Text")]
        pub manifest: String,
        pub generation: i64,
        pub create_time: i64,
        pub update_time: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod pack_triggers {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "pack_triggers")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub pack_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub r#ref: String,
        pub position: i32,
        pub source: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod pack_stimuli {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "pack_stimuli")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub pack_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub position: i32,
        pub r#ref: String,
        pub operation: String,
        pub land: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod pack_commands {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "pack_commands")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub pack_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub position: i32,
        pub name: String,
        pub installs_webhook: bool,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod sense_grants {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "sense_grants")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub principal: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub pack_id: String,
        pub create_time: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod sense_activations {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "sense_activations")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub principal: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub pack_id: String,
        pub enabled: bool,
        pub route: String,
        pub update_time: i64,
        /// CEL; empty: no filter.
        pub filter: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod bindings {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "bindings")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub principal: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub pack_id: String,
        pub binding_id: String,
        pub mode: String,
        pub state: String,
        pub update_time: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod execute_states {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "execute_states")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub principal: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub pack_id: String,
        pub installed: bool,
        pub activated: bool,
        pub connected: bool,
        pub update_time: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod project_members {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "project_members")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub project: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub principal: String,
        pub create_time: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod records {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "records")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub record_id: String,
        pub principal: String,
        pub binding_id: String,
        pub land: String,
        pub pack_id: String,
        pub r#ref: String,
        #[sea_orm(column_type = "Text")]
        pub payload: String,
        pub route: String,
        pub project: Option<String>,
        pub producer_trigger_id: Option<String>,
        pub received_time: i64,
        pub commit_txid: i64,
        pub seq: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}

    /// Every column of a record, in the order `from_row!` reads them: what a look-up that
    /// reads through a driver directly (not sea-orm) selects.
    macro_rules! columns {
        () => {
            "record_id, principal, binding_id, land, pack_id, \"ref\", payload, route, \
             project, producer_trigger_id, received_time, commit_txid, seq"
        };
    }
    pub(crate) use columns;

    /// A `Model` from a driver's row of `columns!()`, each column read by `$row.$get(index)?`
    /// (rusqlite's `get`, sqlx's `try_get`).
    macro_rules! from_row {
        ($row:ident . $get:ident) => {
            $crate::store::entity::records::Model {
                record_id: $row.$get(0)?,
                principal: $row.$get(1)?,
                binding_id: $row.$get(2)?,
                land: $row.$get(3)?,
                pack_id: $row.$get(4)?,
                r#ref: $row.$get(5)?,
                payload: $row.$get(6)?,
                route: $row.$get(7)?,
                project: $row.$get(8)?,
                producer_trigger_id: $row.$get(9)?,
                received_time: $row.$get(10)?,
                commit_txid: $row.$get(11)?,
                seq: $row.$get(12)?,
            }
        };
    }
    pub(crate) use from_row;
}

pub mod drop_reports {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "drop_reports")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub pack_id: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub r#ref: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub reason: String,
        pub count: i64,
        pub first_seen: i64,
        pub last_seen: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod audit_events {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "audit_events")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub event_id: String,
        pub event_time: i64,
        pub actor: String,
        pub role: String,
        pub rpc: String,
        pub pack_id: Option<String>,
        pub principal: Option<String>,
        #[sea_orm(column_type = "Text", nullable)]
        pub before: Option<String>,
        #[sea_orm(column_type = "Text", nullable)]
        pub after: Option<String>,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod ingress_routes {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, PartialEq, Eq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "ingress_routes")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub route_id: String,
        pub pack_id: String,
        pub kind: String,
        #[sea_orm(column_type = "Text")]
        pub mapping: String,
        /// Credentials: never in the audit log, never printed.
        #[serde(skip)]
        #[sea_orm(column_type = "Text")]
        pub secrets: String,
        pub fan_out: bool,
        pub type_prefix: String,
        pub nats_stream: String,
        pub nats_subject: String,
        pub update_time: i64,
    }

    impl std::fmt::Debug for Model {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("ingress_routes::Model")
                .field("route_id", &self.route_id)
                .field("pack_id", &self.pack_id)
                .finish_non_exhaustive()
        }
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod ingress_ledger {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "ingress_ledger")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub scope: String,
        #[sea_orm(primary_key, auto_increment = false)]
        pub delivery_key: String,
        pub route_id: String,
        pub content_digest: Option<String>,
        pub claim_until: Option<i64>,
        pub decide_time: i64,
        pub expire_time: Option<i64>,
        #[sea_orm(column_type = "Text")]
        pub answer: String,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

pub mod sense_quotas {
    use sea_orm::entity::prelude::*;

    #[derive(Clone, Debug, PartialEq, DeriveEntityModel, serde::Serialize)]
    #[sea_orm(table_name = "sense_quotas")]
    pub struct Model {
        #[sea_orm(primary_key, auto_increment = false)]
        pub pack_id: String,
        /// Empty: the pack-wide quota.
        #[sea_orm(primary_key, auto_increment = false)]
        pub principal: String,
        pub rate_per_second: f64,
        pub burst: i64,
        /// The fleet's bucket, which the audit log leaves out.
        #[serde(skip)]
        pub tokens: f64,
        #[serde(skip)]
        pub refill_time: i64,
        pub update_time: i64,
    }

    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}
