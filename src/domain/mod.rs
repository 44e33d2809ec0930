//! The Sense domain: names, pack manifests and their lint, the policy view and the decision. No gRPC, no SQL.
/// `as_str`, `parse`, `NAMES` and `Display` for an enum of named values, once for every such enum.
macro_rules! str_enum {
    ($t:ty { $($v:ident = $s:literal),+ $(,)? }) => {
        impl $t {
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$v => $s),+ }
            }
            pub fn parse(s: &str) -> Option<Self> {
                match s { $($s => Some(Self::$v),)+ _ => None }
            }
            /// Every value's name, for messages.
            pub const NAMES: &'static [&'static str] = &[$($s),+];
        }
        /// As its name: how audit rows and other JSON show it.
        impl ::serde::Serialize for $t {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
        impl ::std::fmt::Display for $t {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

pub mod catalog;
pub(crate) mod cel;
mod checks;
pub mod decide;
pub mod decision_log;
pub mod explain;
pub mod filter;
pub mod ingress;
pub mod model;
pub mod names;
pub mod pack;
pub mod policy;
#[cfg(test)]
mod props;
pub mod quota;
pub mod trigger;
