// ctorch/state_dict.hpp: the empty ItemDict, defined in the room that declares it (core), so
// that the strategies' state dicts and the snapshot below or beside them call down, never up.
#include "ctorch/state_dict.hpp"

namespace ctorch {

ItemDict newItemDict() {
  return c10::impl::toTypedDict<std::string, c10::IValue>(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
}

} // namespace ctorch
