// Uses the installed library the way a user's trainer would.
#include <ctorch/version.hpp>

#include <iostream>

int main() {
  std::cout << ctorch::versionString() << "\n";
  return 0;
}
