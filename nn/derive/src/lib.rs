//! `#[derive(Module)]` for tandem-nn.
//!
//! The derive reads a struct's fields and writes everything of `tandem_nn::Module` except the
//! computation, which the struct gives in `impl Forward for … { fn forward(..) }`. See the
//! documentation of `tandem_nn::Module` for the field rules; this crate is not used directly.
#![warn(missing_docs)]

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as Tokens};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{
    parse_macro_input, Data, DeriveInput, Field, Fields, GenericArgument, Ident, PathArguments,
    Type,
};

/// Implements `tandem_nn::Module` for a struct with named fields (see `tandem_nn::Module`).
///
/// Fields are recognised by type: `TrainingFlag` (exactly one, unless a field is
/// `#[module(delegate)]`), `Child`, `Option<Child>`, `Vec<Child>`; by attribute: `#[param]` and
/// `#[buffer]` on `Tensor` or `Option<Tensor>` fields, `#[module(delegate)]` on a module the
/// struct wraps, `#[module(skip)]` on anything to leave alone. A `Tensor` field without an
/// attribute, and a bare `Arc<dyn Module>` field, are compile errors. `#[module(fused)]` on the
/// struct means it implements `Fused` too.
#[proc_macro_derive(Module, attributes(param, buffer, module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match expand(&input) {
        Ok(tokens) => tokens.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// What a field is to the module.
enum Role {
    Flag,
    Child,
    OptionalChild,
    ChildList,
    Tensor { buffer: bool, optional: bool },
    Delegate,
    Ignored,
}

/// A field with its role.
struct Member<'a> {
    ident: &'a Ident,
    role: Role,
}

/// The `#[module(...)]` words on an attribute list.
fn module_words(attrs: &[syn::Attribute]) -> syn::Result<Vec<Ident>> {
    let mut words = Vec::new();
    for attr in attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|meta| {
            match meta.path.get_ident() {
                Some(ident) => words.push(ident.clone()),
                None => return Err(meta.error("expected a word such as `skip`")),
            }
            Ok(())
        })?;
    }
    Ok(words)
}

/// The last segment of a type path (`tandem_nn::Child` → `Child`) and its single generic
/// argument, if any.
fn last_segment(ty: &Type) -> Option<(&Ident, Option<&Type>)> {
    let Type::Path(p) = ty else { return None };
    let seg = p.path.segments.last()?;
    let arg = match &seg.arguments {
        PathArguments::AngleBracketed(a) if a.args.len() == 1 => match &a.args[0] {
            GenericArgument::Type(t) => Some(t),
            _ => None,
        },
        _ => None,
    };
    Some((&seg.ident, arg))
}

fn is_named(ty: &Type, name: &str) -> bool {
    last_segment(ty).is_some_and(|(ident, _)| ident == name)
}

/// `Wrapper<Inner>` with the given names.
fn is_wrapped(ty: &Type, wrapper: &str, inner: &str) -> bool {
    last_segment(ty)
        .is_some_and(|(ident, arg)| ident == wrapper && arg.is_some_and(|t| is_named(t, inner)))
}

/// Whether `ty` mentions `dyn Module` (a bare shared module the derive cannot replace).
fn mentions_dyn_module(ty: &Type) -> bool {
    let text = quote!(#ty).to_string().replace(' ', "");
    text.contains("dynModule") || text.contains("dyn::tandem_nn::Module")
}

fn classify(field: &Field) -> syn::Result<Member<'_>> {
    let ident = field
        .ident
        .as_ref()
        .ok_or_else(|| syn::Error::new(field.span(), "Module needs named fields"))?;
    let words = module_words(&field.attrs)?;
    let param = field.attrs.iter().any(|a| a.path().is_ident("param"));
    let buffer = field.attrs.iter().any(|a| a.path().is_ident("buffer"));
    let ty = &field.ty;
    let role = if words.iter().any(|w| w == "skip") {
        Role::Ignored
    } else if words.iter().any(|w| w == "delegate") {
        Role::Delegate
    } else if let Some(w) = words.first() {
        return Err(syn::Error::new(
            w.span(),
            "unknown #[module(..)] word on a field: use `skip` or `delegate`",
        ));
    } else if param || buffer {
        if param && buffer {
            return Err(syn::Error::new(
                field.span(),
                "a field is #[param] or #[buffer], not both",
            ));
        }
        let optional = if is_named(ty, "Tensor") {
            false
        } else if is_wrapped(ty, "Option", "Tensor") {
            true
        } else {
            return Err(syn::Error::new(
                ty.span(),
                "#[param] and #[buffer] go on `Tensor` or `Option<Tensor>` fields",
            ));
        };
        Role::Tensor { buffer, optional }
    } else if is_named(ty, "TrainingFlag") {
        Role::Flag
    } else if is_named(ty, "Child") {
        Role::Child
    } else if is_wrapped(ty, "Option", "Child") {
        Role::OptionalChild
    } else if is_wrapped(ty, "Vec", "Child") {
        Role::ChildList
    } else if is_named(ty, "Tensor") || is_wrapped(ty, "Option", "Tensor") {
        return Err(syn::Error::new(
            ty.span(),
            "mark this tensor #[param] (trained), #[buffer] (saved, not trained) or \
             #[module(skip)] (neither): an unmarked tensor would be missing from the \
             optimizer, checkpoints and DDP",
        ));
    } else if mentions_dyn_module(ty) {
        return Err(syn::Error::new(
            ty.span(),
            "hold a child module as `Child` (or `Option<Child>`, `Vec<Child>`), so that it is \
             visited, named and replaceable; #[module(skip)] if it is not a child",
        ));
    } else {
        Role::Ignored
    };
    Ok(Member { ident, role })
}

/// Where the `tandem_nn` crate is, seen from the crate using the derive.
fn nn_path() -> Tokens {
    use proc_macro_crate::{crate_name, FoundCrate};
    match crate_name("tandem-nn") {
        // Inside tandem-nn itself, `extern crate self as tandem_nn` makes this path work.
        Ok(FoundCrate::Itself) => quote!(::tandem_nn),
        Ok(FoundCrate::Name(name)) => {
            let ident = Ident::new(&name, Span::call_site());
            quote!(::#ident)
        }
        Err(_) => match crate_name("tandem") {
            Ok(FoundCrate::Name(name)) => {
                let ident = Ident::new(&name, Span::call_site());
                quote!(::#ident::nn)
            }
            _ => quote!(::tandem_nn),
        },
    }
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new(
            input.span(),
            "#[derive(Module)] works on structs",
        ));
    };
    let Fields::Named(fields) = &data.fields else {
        return Err(syn::Error::new(
            input.span(),
            "#[derive(Module)] needs a struct with named fields",
        ));
    };
    let members = fields
        .named
        .iter()
        .map(classify)
        .collect::<syn::Result<Vec<_>>>()?;
    let fused = module_words(&input.attrs)?;
    if let Some(w) = fused.iter().find(|w| *w != "fused") {
        return Err(syn::Error::new(
            w.span(),
            "unknown #[module(..)] word on a struct: use `fused`",
        ));
    }
    let fused = !fused.is_empty();
    let nn = nn_path();
    let name = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();

    let training = training_flag(input, &members, &nn)?;
    let visit_own = visit_own(&members, &nn);
    let children = children(&members, &nn);
    let replace = replace_child(&members, &nn);
    let bind = bind_names(&members);
    let fused_fn = fused.then(|| {
        quote! {
            fn fused(&self) -> ::std::option::Option<&dyn #nn::Fused> {
                ::std::option::Option::Some(self)
            }
        }
    });
    Ok(quote! {
        impl #impl_generics #name #ty_generics #where_clause {
            /// Runs the module (its `Forward::forward`) with its children named for error
            /// messages.
            pub fn forward(&self, x: &#nn::__derive::Tensor) -> #nn::Result<#nn::__derive::Tensor> {
                self.__tandem_bind_names();
                <Self as #nn::Forward>::forward(self, x)
            }

            #[doc(hidden)]
            #[inline]
            fn __tandem_bind_names(&self) {
                #bind
            }
        }

        impl #impl_generics #nn::Module for #name #ty_generics #where_clause {
            fn forward(&self, x: &#nn::__derive::Tensor) -> #nn::Result<#nn::__derive::Tensor> {
                Self::forward(self, x)
            }

            #training
            #visit_own
            #children
            #replace
            #fused_fn
        }
    })
}

fn training_flag(input: &DeriveInput, members: &[Member], nn: &Tokens) -> syn::Result<Tokens> {
    let flags: Vec<_> = members
        .iter()
        .filter(|m| matches!(m.role, Role::Flag))
        .collect();
    let delegates: Vec<_> = members
        .iter()
        .filter(|m| matches!(m.role, Role::Delegate))
        .collect();
    if delegates.len() > 1 {
        return Err(syn::Error::new(
            delegates[1].ident.span(),
            "at most one #[module(delegate)] field",
        ));
    }
    let body = match (flags.as_slice(), delegates.first()) {
        ([flag], None) => {
            let f = flag.ident;
            quote!(&self.#f)
        }
        ([], Some(d)) => {
            let f = d.ident;
            quote!(#nn::Module::training_flag(&*self.#f))
        }
        ([], None) => {
            return Err(syn::Error::new(
                input.ident.span(),
                "a module needs a `TrainingFlag` field (its train/eval switch), or a \
                 #[module(delegate)] field whose flag it shares",
            ))
        }
        (_, _) => {
            return Err(syn::Error::new(
                input.ident.span(),
                "a module has exactly one train/eval flag: one `TrainingFlag` field, or a \
                 #[module(delegate)] field",
            ))
        }
    };
    Ok(quote! {
        fn training_flag(&self) -> &#nn::TrainingFlag {
            #body
        }
    })
}

/// Own tensors in PyTorch's order: parameters, then buffers, each in field order; a delegate's
/// tensors come first, as its own.
fn visit_own(members: &[Member], nn: &Tokens) -> Tokens {
    let mut body = Tokens::new();
    for m in members {
        if let Role::Delegate = m.role {
            let f = m.ident;
            body.extend(quote!(#nn::Module::visit_own(&*self.#f, visitor);));
        }
    }
    for want_buffer in [false, true] {
        for m in members {
            let Role::Tensor { buffer, optional } = m.role else {
                continue;
            };
            if buffer != want_buffer {
                continue;
            }
            let f = m.ident;
            let key = f.to_string();
            let kind = if buffer {
                quote!(#nn::ParamKind::Buffer)
            } else {
                quote!(#nn::ParamKind::Parameter)
            };
            body.extend(if optional {
                quote! {
                    if let ::std::option::Option::Some(t) = &self.#f {
                        visitor(#key, #kind, t);
                    }
                }
            } else {
                quote!(visitor(#key, #kind, &self.#f);)
            });
        }
    }
    quote! {
        fn visit_own(&self, visitor: &mut dyn FnMut(&str, #nn::ParamKind, &#nn::__derive::Tensor)) {
            let _ = &visitor;
            #body
        }
    }
}

fn children(members: &[Member], nn: &Tokens) -> Tokens {
    let mut body = Tokens::new();
    for m in members {
        let f = m.ident;
        let key = f.to_string();
        body.extend(match m.role {
            Role::Delegate => quote! {
                out.extend(#nn::Module::children(&*self.#f));
            },
            Role::Child => quote! {
                out.push((::std::string::String::from(#key), self.#f.get()));
            },
            Role::OptionalChild => quote! {
                if let ::std::option::Option::Some(c) = &self.#f {
                    out.push((::std::string::String::from(#key), c.get()));
                }
            },
            Role::ChildList => quote! {
                for (i, c) in self.#f.iter().enumerate() {
                    out.push((::std::format!("{}.{}", #key, i), c.get()));
                }
            },
            _ => Tokens::new(),
        });
    }
    quote! {
        fn children(&self) -> ::std::vec::Vec<(::std::string::String, #nn::__derive::Arc<dyn #nn::Module>)> {
            self.__tandem_bind_names();
            #[allow(unused_mut)]
            let mut out = ::std::vec::Vec::new();
            #body
            out
        }
    }
}

fn replace_child(members: &[Member], nn: &Tokens) -> Tokens {
    let mut body = Tokens::new();
    for m in members {
        let f = m.ident;
        let key = f.to_string();
        body.extend(match m.role {
            Role::Delegate => quote! {
                if #nn::Module::children(&*self.#f).iter().any(|(n, _)| n == name) {
                    return #nn::Module::replace_child(&*self.#f, name, module);
                }
            },
            Role::Child => quote! {
                if name == #key {
                    return ::std::result::Result::Ok(self.#f.replace(module));
                }
            },
            Role::OptionalChild => quote! {
                if let (true, ::std::option::Option::Some(c)) = (name == #key, &self.#f) {
                    return ::std::result::Result::Ok(c.replace(module));
                }
            },
            Role::ChildList => quote! {
                if let ::std::option::Option::Some(c) = name
                    .strip_prefix(#key)
                    .and_then(|rest| rest.strip_prefix('.'))
                    .and_then(|i| i.parse::<usize>().ok())
                    .and_then(|i| self.#f.get(i))
                {
                    return ::std::result::Result::Ok(c.replace(module));
                }
            },
            _ => Tokens::new(),
        });
    }
    quote! {
        fn replace_child(
            &self,
            name: &str,
            module: #nn::__derive::Arc<dyn #nn::Module>,
        ) -> #nn::Result<#nn::__derive::Arc<dyn #nn::Module>> {
            #body
            ::std::result::Result::Err(#nn::__derive::no_such_child(self, name))
        }
    }
}

/// Gives each `Child` its field name (once; later calls are a load each).
fn bind_names(members: &[Member]) -> Tokens {
    let mut body = Tokens::new();
    for m in members {
        let f = m.ident;
        let key = f.to_string();
        body.extend(match m.role {
            Role::Child => quote_spanned!(f.span()=> self.#f.bind_name(#key);),
            Role::OptionalChild => quote! {
                if let ::std::option::Option::Some(c) = &self.#f {
                    c.bind_name(#key);
                }
            },
            Role::ChildList => quote! {
                for (i, c) in self.#f.iter().enumerate() {
                    c.bind_name_with(|| ::std::format!("{}.{}", #key, i));
                }
            },
            _ => Tokens::new(),
        });
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compile error the derive gives for `src`, or `None` when it expands.
    fn refusal(src: &str) -> Option<String> {
        let input: DeriveInput = syn::parse_str(src).unwrap();
        expand(&input).err().map(|e| e.to_string())
    }

    #[test]
    fn a_model_with_every_kind_of_field_expands() {
        let ok = refusal(
            "struct Net { #[param] w: Tensor, #[buffer] b: Option<Tensor>, a: Child, \
             o: Option<Child>, l: Vec<Child>, t: TrainingFlag, n: usize, \
             #[module(skip)] cache: Tensor }",
        );
        assert_eq!(ok, None);
        let wrapper = "#[module(fused)] struct W { #[module(delegate)] bn: Arc<BatchNorm2d> }";
        assert_eq!(refusal(wrapper), None);
    }

    #[test]
    fn forgotten_tensors_and_children_are_refused() {
        let tensor = refusal("struct Net { w: Tensor, t: TrainingFlag }").unwrap();
        assert!(
            tensor.contains("#[param]") && tensor.contains("#[buffer]"),
            "{tensor}"
        );
        let child = refusal("struct Net { c: Arc<dyn Module>, t: TrainingFlag }").unwrap();
        assert!(child.contains("Child"), "{child}");
        let optional = refusal("struct Net { c: Option<Tensor>, t: TrainingFlag }").unwrap();
        assert!(optional.contains("#[param]"), "{optional}");
    }

    #[test]
    fn the_training_flag_must_be_there_once() {
        let none = refusal("struct Net { c: Child }").unwrap();
        assert!(none.contains("TrainingFlag"), "{none}");
        let two = refusal("struct Net { a: TrainingFlag, b: TrainingFlag }").unwrap();
        assert!(two.contains("exactly one"), "{two}");
        let both = "struct W { #[module(delegate)] bn: Arc<BatchNorm2d>, t: TrainingFlag }";
        assert!(refusal(both).unwrap().contains("exactly one"));
    }

    #[test]
    fn misplaced_attributes_are_refused() {
        let param = refusal("struct Net { #[param] n: usize, t: TrainingFlag }").unwrap();
        assert!(param.contains("Tensor"), "{param}");
        let both = refusal("struct Net { #[param] #[buffer] w: Tensor, t: TrainingFlag }");
        assert!(both.unwrap().contains("not both"));
        let word = refusal("struct Net { #[module(child)] c: Child, t: TrainingFlag }");
        assert!(word.unwrap().contains("skip"));
        let on_struct = refusal("#[module(fast)] struct Net { t: TrainingFlag }");
        assert!(on_struct.unwrap().contains("fused"));
        let tuple = refusal("struct Net(TrainingFlag);").unwrap();
        assert!(tuple.contains("named fields"), "{tuple}");
    }
}
