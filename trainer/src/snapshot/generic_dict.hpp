// Internal: a string-keyed, any-valued c10 dictionary, the building block of the pickled snapshot
// layout (Python reads it back as a plain dict).
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/jit_type.h>

namespace ctorch {

inline c10::impl::GenericDict newStringDict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

} // namespace ctorch
